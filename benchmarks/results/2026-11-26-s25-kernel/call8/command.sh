# session 25, call 8 (carries tilelang-0.1.9 + unpack.sh; after calls 6-7 on the same machine): the planner picks the
# cut aligned to the longest request where plan_cost says so (default now). GPU tests (the plan kernel against the
# torch planner with equal lengths too) beside the precompiles of the whole bench grid + the rope variants; then an
# interleaved A/B of our kernel alone: even = MLA_BACKEND_PLAN_ALIGN=0 (the plans before), auto = default,
# rope = default + MLA_BACKEND_SM90_CLUSTER_ROPE=1
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
G=""; for h in 16 32 64 128; do for q in 1 2; do G="$G;1,4096,$h,$q,64"; done; done
G="${G#;};1,4096,16,1,1;1,4096,16,1,16;1,4096,128,1,1;1,4096,128,1,16"
R="1,4096,128,1,64;1,4096,128,2,64;1,4096,64,2,64"
(timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
python3 scripts/quick_time.py --shapes "$G" --precompile 8 2>&1 | tail -1 &
MLA_BACKEND_SM90_CLUSTER_ROPE=1 python3 scripts/quick_time.py --shapes "$R" --precompile 3 2>&1 | tail -1 &
wait
tail -3 $OUT/pytest_gpu.log
S="64,4096,128,1,64;128,8192,128,1,64;128,16384,128,1,64;64,32768,128,1,64;64,8192,128,2,64;128,16384,16,1,64;128,4096,32,2,64"
SET="even:MLA_BACKEND_PLAN_ALIGN=0 auto: rope:MLA_BACKEND_SM90_CLUSTER_ROPE=1"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=5 timeout 200 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
