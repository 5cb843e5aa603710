#!/bin/bash
# GPU machine: kernel correctness tests + a quick timing of our kernel. Carry .devkit/tilelang-0.1.9.tar.xz
# and .devkit/unpack.sh. Writes logs under $OUT.
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernel_gpu.py "$@" 2>&1 | tee $OUT/pytest_gpu.log
timeout 120 python3 scripts/quick_time.py 2>&1 | tee $OUT/quick_time.log
