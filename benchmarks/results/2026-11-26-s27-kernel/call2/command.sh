# session 27, call 2 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): the whole GPU test file on main b46ab18
# (the default kernel; new: h=128 / h=64 s_q=2 below page 64 with a long request, graph replay at page 16; the
# tiled-vs-per-row bit test with session 26's k_scale fix, not rerun since)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernel_gpu.py 2>&1 | tail -25 | tee $OUT/pytest_gpu.log
