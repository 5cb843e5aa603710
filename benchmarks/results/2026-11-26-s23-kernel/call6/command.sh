# session 23, call 6: the new WG0 order (all four settings) against the session-22 kernel on shapes calls 1-2 did not
# cover: page 16 (cp.async blocks), an e4m3 cache at h=128 and h=64 (fp16 WGMMAs), h=64 s_q=2 (128 rows), b=16
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="64,8192,128,2,16;128,16384,128,1,64,fp8;64,8192,64,2,64;16,16384,128,1,64;128,8192,64,1,64,fp8"
SET="base:MLA_BACKEND_SM90_PVEARLY=0,MLA_BACKEND_SM90_RESCALE=0,MLA_BACKEND_SM90_FFMA=0,MLA_BACKEND_SM90_PFREE=0 new:"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 5 2>&1 | tail -1 & done
wait
AB_ROUNDS=6 timeout 300 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
