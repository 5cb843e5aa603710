# session 24, call 10: GPU tests on the final tree (kernel and tests byte-identical to 836c646, session 23's final)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
git log -1 --format=%H 2>/dev/null | tee $OUT/head.txt
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log; tail -3 $OUT/pytest_gpu.log
