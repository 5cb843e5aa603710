# session 25, call 3 (carries tilelang-0.1.9 + unpack.sh; after calls 1-2 unpacked vllm-c and vllm-deps on the same
# machine): precompile the full bench grid's kernels + the opt-in cluster_kv variants; GPU tests on main's default and
# under CLUSTER_ROPE + CLUSTER_MIX; an interleaved A/B (base / rope / rope+mix) of our kernel alone; racecheck on the
# h=128 page-64 sanitizer case under rope+mix
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
BOTH=MLA_BACKEND_SM90_CLUSTER_ROPE=1,MLA_BACKEND_SM90_CLUSTER_MIX=1
G=""; for h in 16 32 64 128; do for q in 1 2; do G="$G;1,4096,$h,$q,64"; done; done
G="${G#;};1,4096,16,1,1;1,4096,16,1,16;1,4096,128,1,1;1,4096,128,1,16"
S="128,16384,128,1,64;64,8192,128,2,64;16,16384,128,1,64;64,8192,64,2,64"
(timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
(env ${BOTH//,/ } timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu_both.log) &
python3 scripts/quick_time.py --shapes "$G" --precompile 6 2>&1 | tail -1
for e in MLA_BACKEND_SM90_CLUSTER_ROPE=1 $BOTH; do env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
tail -3 $OUT/pytest_gpu.log $OUT/pytest_gpu_both.log
SET="base: rope:MLA_BACKEND_SM90_CLUSTER_ROPE=1 both:$BOTH"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=5 timeout 220 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
env ${BOTH//,/ } timeout 90 compute-sanitizer --tool racecheck --print-limit 4 python3 scripts/sanitize_case.py --cases 3 2>&1 \
  | grep -E "rel err|RACECHECK SUMMARY|hazard" | tail -4 | tee $OUT/racecheck_both.log
