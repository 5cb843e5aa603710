#!/bin/bash
# GPU machine: is the merge ticket's racecheck finding real? (1) scripts/racecheck_ticket.cu, a stand-alone model of
# the hand-off, plain, under racecheck and synccheck; (2) the split kernel on one two-part-merge case under racecheck
# with per-hazard reports (threads, blocks), with and without indirect barrier analysis.
# Carry .devkit/racecheck_ticket (nvcc build, see the .cu), .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh.
set -o pipefail
compute-sanitizer --version | tail -1 | tee $OUT/rc_version.txt
compute-sanitizer --help | grep -A1 -i racecheck | tee -a $OUT/rc_version.txt
./.devkit/racecheck_ticket 2>&1 | tee $OUT/rc_micro_plain.log
for opt in "" "--racecheck-report hazard"; do
  compute-sanitizer --tool racecheck $opt --print-limit 8 ./.devkit/racecheck_ticket 2>&1 | tail -40 | tee -a $OUT/rc_micro.log
done
compute-sanitizer --tool synccheck ./.devkit/racecheck_ticket 2>&1 | tail -8 | tee $OUT/rc_micro_sync.log
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
CASE="from sanitize_case import run_case, SHORT; print('rel err', run_case(16, 128, 2, False, SHORT))"
timeout 200 python3 -c "$CASE" 2>&1 | grep -v Cache | tee $OUT/rc_kernel.log
for opt in "--racecheck-report hazard" "--racecheck-report hazard --racecheck-indirect-barrier-dependency yes"; do
  echo "== $opt" | tee -a $OUT/rc_kernel.log
  timeout 150 compute-sanitizer --tool racecheck $opt --print-limit 6 python3 -c "$CASE" 2>&1 | grep -v Cache \
    | tail -60 | tee -a $OUT/rc_kernel.log
done
