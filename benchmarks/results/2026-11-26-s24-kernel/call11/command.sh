# session 24, call 11: the row-block CTA pairs of a part as a cluster sharing each whole block by TMA multicast
# (cluster_kv, MLA_BACKEND_SM90_CLUSTER=1, on today's kernel: rank 0 issues the left tile, rank 1 the right, each its
# own rope tile; k_free counts the pair's consumers): GPU tests under it beside the precompiles, then an interleaved
# A/B against the default, then racecheck on the sanitizer's h=128 page-64 case under it
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(MLA_BACKEND_SM90_CLUSTER=1 timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu_cluster.log) &
S="128,16384,128,1,64;64,8192,128,2,64;16,16384,128,1,64;64,8192,64,2,64"
SET="base: cluster:MLA_BACKEND_SM90_CLUSTER=1"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu_cluster.log
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=5 timeout 200 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
MLA_BACKEND_SM90_CLUSTER=1 timeout 90 compute-sanitizer --tool racecheck --print-limit 4 python3 scripts/sanitize_case.py --cases 3 2>&1 \
  | grep -E "rel err|RACECHECK SUMMARY|hazard" | tail -4 | tee $OUT/racecheck_cluster.log
