#!/bin/bash
# GPU machine: the merge ticket's hand-off under compute-sanitizer. (1) scripts/racecheck_ticket.cu, a stand-alone
# model of it (variants 0-7), plain, under racecheck and synccheck; (2) the sanitizer cases (scripts/sanitize_case.py)
# plain, under synccheck and racecheck; with GPU_TESTS=1 also tests/test_kernel_gpu.py alongside.
# Carry .devkit/racecheck_ticket (nvcc build, see the .cu), .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh.
set -o pipefail
source .devkit/unpack.sh >/dev/null
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
compute-sanitizer --version | tail -1 | tee $OUT/sanitizer_version.txt
./.devkit/racecheck_ticket 2>&1 | tee $OUT/micro.log
for tool in racecheck synccheck; do
  echo "== $tool" | tee -a $OUT/micro.log
  compute-sanitizer --tool $tool --print-limit 4 ./.devkit/racecheck_ticket 2>&1 | grep -v "Host Frame" | tail -25 \
    | tee -a $OUT/micro.log
done
if [ -n "${GPU_TESTS:-}" ]; then
  (timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py > $OUT/pytest_gpu.log 2>&1
   echo "pytest rc $?" >> $OUT/pytest_gpu.log) &
fi
timeout 200 python3 scripts/sanitize_case.py 2>&1 | grep "rel err" | tee $OUT/sanitize_plain.log
for tool in synccheck racecheck; do
  timeout 170 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py 2>&1 \
    | grep -v "Cache\|Host Frame\|WARNING" | tail -40 | tee $OUT/sanitize_$tool.log
done
wait
[ -n "${GPU_TESTS:-}" ] && tail -4 $OUT/pytest_gpu.log
exit 0
