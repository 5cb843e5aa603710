#!/bin/bash
# GPU machine: the split_pv kernel (MLA_BACKEND_SM90_KERNEL=tsplit) against the fp32 reference on ragged cases, then
# an interleaved A/B against tws (with and without its in-kernel merge) with the SM clock sampled.
#   AB_SHAPES="b,s,h,s_q,page;..." CHECK="page,heads,q_len;..." bash scripts/device_split.sh
# Carry .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh.
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
SETTINGS=${AB_SETTINGS:-"tws:MLA_BACKEND_SM90_KERNEL=tws tws_nomerge:MLA_BACKEND_SM90_KERNEL=tws,MLA_BACKEND_SM90_MERGE=0 split:MLA_BACKEND_SM90_KERNEL=tsplit"}
CHECK_SHAPES=$(echo "$CHECK" | tr ';' '\n' | awk -F, 'NF {printf "%s4,512,%s,%s,%s", sep, $2, $3, $1; sep=";"}')
for setting in $SETTINGS; do
  e=${setting#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$AB_SHAPES" --precompile 5 2>&1 | tail -1 &
done
MLA_BACKEND_SM90_KERNEL=tsplit python3 scripts/quick_time.py --shapes "$CHECK_SHAPES" --precompile 6 2>&1 | tail -1 &
wait
MLA_BACKEND_SM90_KERNEL=tsplit timeout 200 python3 - "$CHECK" <<'PY' 2>&1 | tee $OUT/check.log
import sys
from sanitize_case import SHORT, LONG, run_case
bad = 0
for c in sys.argv[1].split(";"):
    page, heads, q_len = (int(v) for v in c.split(","))
    for lens in (SHORT, LONG):
        err = run_case(page, heads, q_len, False, lens)
        bad += not err < 1e-2
        print(f"tsplit page={page} h={heads} s_q={q_len} lens={lens}: rel err {err:.2e}", flush=True)
print("CHECK", "FAILED" if bad else "passed")
PY
grep -q "CHECK passed" $OUT/check.log || exit 1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 100 > $OUT/clocks.csv &
smi=$!
AB_ROUNDS=${AB_ROUNDS:-3} timeout 330 python3 scripts/ab_interleave.py "$AB_SHAPES" $SETTINGS 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi
awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' $OUT/clocks.csv | tee $OUT/clocks_summary.txt
rm -f $OUT/clocks.csv
