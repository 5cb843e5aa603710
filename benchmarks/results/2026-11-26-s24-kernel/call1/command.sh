# session 24, call 1: tiles of a whole TMA block gathered by cp.async instead (MLA_BACKEND_SM90_CPASYNC = r / l / t),
# so the LSU path copies beside the TMA unit; correctness on the sanitizer's h=128 cases per setting, then an
# interleaved A/B (graph replay after an L2 flush)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,64;64,8192,128,2,64;128,8192,64,1,64"
SET="all: r:MLA_BACKEND_SM90_CPASYNC=r l:MLA_BACKEND_SM90_CPASYNC=l t:MLA_BACKEND_SM90_CPASYNC=t"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
for x in $SET; do e=${x#*:}; echo "== $x"; env ${e//,/ } timeout 120 python3 scripts/sanitize_case.py --cases 2,3 2>&1 | grep "rel err"; done | tee $OUT/correct.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=5 timeout 300 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
