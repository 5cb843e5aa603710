source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,64;64,8192,128,2,64"
SET="chain:MLA_BACKEND_SM90_TREEMAX=0 tree:MLA_BACKEND_SM90_TREEMAX=1"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 2 2>&1 | tail -1 & done
wait
AB_ROUNDS=4 timeout 150 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
