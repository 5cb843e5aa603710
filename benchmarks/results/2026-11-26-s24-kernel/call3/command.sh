# session 24, call 3: one k_free arrival per consumer warpgroup and one p_free arrival of WG1 (few_arrivals,
# MLA_BACKEND_SM90_FEWARRIVE=1) with and without P's named-barrier hand-over (named_p_ready, default in this tree):
# correctness on the sanitizer's h=128 cases (plain and racecheck), then an interleaved A/B of the four settings
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,64;64,8192,128,2,64;16,16384,128,1,64;128,8192,64,1,64"
SET="base:MLA_BACKEND_SM90_NAMEDP=0 named: few:MLA_BACKEND_SM90_NAMEDP=0,MLA_BACKEND_SM90_FEWARRIVE=1 both:MLA_BACKEND_SM90_FEWARRIVE=1"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
for x in few:MLA_BACKEND_SM90_NAMEDP=0,MLA_BACKEND_SM90_FEWARRIVE=1 both:MLA_BACKEND_SM90_FEWARRIVE=1; do
  e=${x#*:}; echo "== $x"; env ${e//,/ } timeout 60 python3 scripts/sanitize_case.py --cases 2,3 2>&1 | grep "rel err"
  env ${e//,/ } timeout 100 compute-sanitizer --tool racecheck --print-limit 4 python3 scripts/sanitize_case.py --cases 3 2>&1 \
    | grep -E "rel err|RACECHECK SUMMARY|hazard" | tail -3
done | tee $OUT/correct.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=6 timeout 300 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
