# session 23, call 7: WG0's P V in four 16-token chunks issued as P's exp2s produce them (pv_chunks, mla_pv_chunk):
# GPU tests with it on (the default of this tree), then an A/B against the same kernel without it and session 22's
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
S="128,16384,128,1,64;64,8192,128,2,64;64,8192,128,2,16;128,8192,64,1,64"
SET="chunks: nochunks:MLA_BACKEND_SM90_PVCHUNKS=0 base:MLA_BACKEND_SM90_PVEARLY=0,MLA_BACKEND_SM90_RESCALE=0,MLA_BACKEND_SM90_FFMA=0,MLA_BACKEND_SM90_PFREE=0"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu.log
AB_ROUNDS=6 timeout 260 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
