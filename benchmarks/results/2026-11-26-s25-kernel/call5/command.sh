# session 25, call 5 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): the full grid's worst rows are fixed
# lengths whose parts straddle requests. Interleaved A/B of our kernel alone, plans by torch ops (precomputed):
#   base  = today's plan (equal parts of ceil(total / parts) blocks)
#   align = parts aligned to the longest request (MLA_BACKEND_PLAN_ALIGN=1, experiment)
#   qlate = a segment's first block issued before its Q (MLA_BACKEND_SM90_QLATE=1)
#   both  = align + qlate
# GPU tests under QLATE=1 beside the precompiles, then racecheck on the sanitizer's h=128 page-64 case under it.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="64,4096,128,1,64;128,4096,128,1,64;64,8192,128,1,64;16,16384,128,1,64;128,16384,128,1,64;128,4096,64,1,64"
S="$S;128,16384,16,1,64;64,8192,128,2,64;128,4096,32,2,64;64,4096,64,2,64"
(MLA_BACKEND_SM90_QLATE=1 timeout 360 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu_qlate.log) &
for q in 0 1; do MLA_BACKEND_SM90_QLATE=$q python3 scripts/quick_time.py --shapes "$S" --precompile 6 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu_qlate.log
P=MLA_BACKEND_PLAN_KERNEL=0
SET="base:$P align:$P,MLA_BACKEND_PLAN_ALIGN=1 qlate:$P,MLA_BACKEND_SM90_QLATE=1 both:$P,MLA_BACKEND_PLAN_ALIGN=1,MLA_BACKEND_SM90_QLATE=1"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=4 timeout 240 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
MLA_BACKEND_SM90_QLATE=1 timeout 90 compute-sanitizer --tool racecheck --print-limit 4 python3 scripts/sanitize_case.py --cases 3 2>&1 \
  | grep -E "rel err|RACECHECK SUMMARY|hazard" | tail -4 | tee $OUT/racecheck_qlate.log
