#!/bin/bash
# GPU machine: interleaved A/B of kernel settings (scripts/ab_interleave.py) with the SM clock, power and throttle
# reasons sampled every 100 ms; then compute-sanitizer memcheck of the small cases under $MLA_BACKEND_SM90_KERNEL.
#   AB_SHAPES="64,8192,128,2,64;..." AB_SETTINGS="tws:MLA_BACKEND_SM90_KERNEL=tws tma:..." bash scripts/device_interleave.sh
#   GPU_TESTS=1 ...: first the smoke case and tests/test_kernel_gpu.py (its log: $OUT/pytest_gpu.log)
# Carry .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh.
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
[ -n "${GPU_TESTS:-}" ] && GPU_TESTS_BG=1 source scripts/device_gpu_tests.sh  # the tests beside the precompiles
for setting in $AB_SETTINGS; do
  e=${setting#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$AB_SHAPES" --precompile 4 2>&1 | tail -1 &
done
[ -n "${MEMCHECK:-}" ] && timeout 200 python3 scripts/sanitize_case.py 2>&1 | grep "rel err" | tee $OUT/sanitize_plain.log
wait
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 100 > $OUT/clocks.csv &
smi=$!
timeout 300 python3 scripts/ab_interleave.py "$AB_SHAPES" $AB_SETTINGS 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi
awk -F', ' 'NR>1 {n++; c+=$2; p+=$3; r[$5]++} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W; reasons:", n, c/n, p/n; for (k in r) printf " %s x%d", k, r[k]; print ""}' $OUT/clocks.csv | tee $OUT/clocks_summary.txt
[ -n "${MEMCHECK:-}" ] && timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 scripts/sanitize_case.py 2>&1 \
  | grep -E "rel err|ERROR SUMMARY|Invalid" | tail -12 | tee $OUT/memcheck.log
exit 0
