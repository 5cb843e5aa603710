# session 25, call 15 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): tma_pages (opt-in): page sizes 16 / 32
# by TMA, one box per page and 64 dims, with the pairs at h=128. GPU tests under MLA_BACKEND_SM90_TMA_PAGES=1 beside
# the precompiles, an interleaved A/B of our kernel alone (base / pages; the p64 row is a control: same kernel), then
# racecheck + memcheck on the sanitizer's page-16 h=128 s_q=2 case under it
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,16;128,16384,128,1,32;64,8192,128,2,16;128,16384,64,1,16;128,4096,32,2,16;128,16384,128,1,64"
(MLA_BACKEND_SM90_TMA_PAGES=1 timeout 360 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu_pages.log) &
for v in 0 1; do MLA_BACKEND_SM90_TMA_PAGES=$v python3 scripts/quick_time.py --shapes "$S" --precompile 6 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu_pages.log
SET="base: pages:MLA_BACKEND_SM90_TMA_PAGES=1"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=5 timeout 200 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
for tool in racecheck memcheck; do
  MLA_BACKEND_SM90_TMA_PAGES=1 timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 2 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -6 | tee $OUT/sanitize_$tool.log
done
