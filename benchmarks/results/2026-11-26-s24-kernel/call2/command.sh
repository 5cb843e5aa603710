# session 24, call 2: P's hand-over from WG0 to WG1 on a named barrier (named_p_ready, default on in this tree;
# MLA_BACKEND_SM90_NAMEDP=0 keeps the p_ready mbarrier): GPU tests on the new default beside the precompiles, an
# interleaved A/B (graph replay after an L2 flush), then racecheck / synccheck on the h=128 sanitizer cases
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
S="128,16384,128,1,64;64,8192,128,2,64;64,8192,128,2,16;16,16384,128,1,64;128,8192,64,1,64"
SET="base:MLA_BACKEND_SM90_NAMEDP=0 new:"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=6 timeout 240 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
for tool in racecheck synccheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 4 python3 scripts/sanitize_case.py --cases 2,3 2>&1 \
    | grep -E "rel err|ERROR SUMMARY|RACECHECK SUMMARY|hazard" | tail -6 | tee $OUT/$tool.log
done
