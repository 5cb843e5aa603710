# session 25, call 10 (carries tilelang-0.1.9 + unpack.sh; the machine of calls 6-9): cluster_rope is the default now
# (the rope box multicast by rank g % 2). GPU tests on it, then compute-sanitizer racecheck + memcheck on the
# sanitizer's h=128 page-64 case (the pairs' launch)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
for tool in racecheck memcheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 3 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -6 | tee $OUT/sanitize_$tool.log
done
wait
tail -3 $OUT/pytest_gpu.log
