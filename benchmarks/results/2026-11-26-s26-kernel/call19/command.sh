# session 26, call 19 (carries tilelang-0.1.9 + unpack.sh; the machine of calls 17-18): the tiled combine sums each
# row's weights in part order (the per-row combine's bits up to 8 parts). GPU tests (new: tiled and per-row combines
# equal bit for bit), and the tiny model's kernel variant compiled for call 20's engines
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log
tail -3 $OUT/pytest_gpu.log
