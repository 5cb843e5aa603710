#!/bin/bash
# GPU machine: the merge ticket's hand-off under compute-sanitizer. (1) scripts/racecheck_ticket.cu, a stand-alone
# model of it (variants 0-7), plain, under racecheck and synccheck; (2) the sanitizer cases under synccheck and
# racecheck (scripts/device_profile.sh); with GPU_TESTS=1 also tests/test_kernel_gpu.py alongside.
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
SANITIZERS="synccheck racecheck" NO_NCU=1 bash scripts/device_profile.sh
wait
[ -n "${GPU_TESTS:-}" ] && tail -4 $OUT/pytest_gpu.log
exit 0
