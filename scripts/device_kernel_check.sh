#!/bin/bash
# GPU machine: kernel correctness tests + a quick timing, for each Hopper kernel (MLA_BACKEND_SM90_KERNEL).
# Carry .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh. Writes logs under $OUT.
#   bash scripts/device_kernel_check.sh [KERNELS [TIME_ONLY_KERNELS]]   (default "pipelined ws seesaw")
#   e.g. FP8=1 bash scripts/device_kernel_check.sh "tws ws"   (the transposed kernel's first GPU run and A/B)
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
for k in ${1:-pipelined ws seesaw}; do
  export MLA_BACKEND_SM90_KERNEL=$k
  # one small case first: a hang (barrier protocol) costs 90 s, not the whole call
  timeout 90 python3 scripts/quick_time.py --smoke 2>&1 | tail -5 | tee $OUT/smoke_$k.log || { echo "SMOKE FAILED ($k)"; continue; }
  timeout ${PYTEST_TIMEOUT:-220} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 | tee $OUT/pytest_gpu_$k.log
  timeout 120 python3 scripts/quick_time.py 2>&1 | grep -v Cache | tee $OUT/quick_time_$k.log
done
for k in ${2:-}; do MLA_BACKEND_SM90_KERNEL=$k timeout 120 python3 scripts/quick_time.py 2>&1 | grep -v Cache | tee $OUT/quick_time_$k.log; done
# FP8=1: bf16 and e4m3 caches side by side, per kernel of the first list (e.g. "ws tws": the A/B of tws)
if [ -n "${FP8:-}" ]; then
  for k in ${1:-ws}; do
    MLA_BACKEND_SM90_KERNEL=$k timeout 150 python3 scripts/quick_time.py --fp8 2>&1 | grep -v Cache | tee $OUT/quick_time_fp8_$k.log
  done
fi
