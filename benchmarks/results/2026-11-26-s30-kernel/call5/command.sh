# session 30, call 5 (a fresh machine; carries tilelang-0.1.9 + unpack.sh): the whole GPU test file on the final main
# (mla_backend/ and tests/ as at 267100e, session 29's last commit; this session's experiment reverted) under TileLang
# 0.1.9, vLLM's pin.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 540 python3 -u -m pytest -q -rf -p no:cacheprovider tests/test_kernel_gpu.py > $OUT/pytest_gpu.txt 2>&1; tail -4 $OUT/pytest_gpu.txt
