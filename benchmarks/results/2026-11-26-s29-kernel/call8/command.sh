# session 29, call 8 (a fresh machine; carries tilelang-0.1.9 + unpack.sh): the whole GPU test file on the final main
# (session 28's kernels plus the plan kernel's wait; every experiment of this session reverted) under TileLang 0.1.9,
# vLLM's pin (call 5 ran it under 0.1.11). Variants precompiled in parallel first.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
# (a git log here printed c74560a: the device's copy of the tree keeps a stale .git; the tree was main at ea8eb34)
timeout 520 python3 -u -m pytest -q -rf -p no:cacheprovider tests/test_kernel_gpu.py > $OUT/pytest_gpu.txt 2>&1; tail -4 $OUT/pytest_gpu.txt
