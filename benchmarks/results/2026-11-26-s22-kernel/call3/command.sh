source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
S="128,16384,128,1,64;64,8192,128,2,64;64,8192,128,2,16;128,8192,64,1,64"
SET="off:MLA_BACKEND_SM90_SOFTMAX=0 tree:MLA_BACKEND_SM90_FMAEXP=0 fma2:MLA_BACKEND_SM90_FMAEXP=2 fma3:MLA_BACKEND_SM90_FMAEXP=3"
for x in $SET; do e=${x#*:}; env ${e//,/ } python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 & done
wait
cat $OUT/pytest_gpu.log | tail -5
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 100 > /tmp/clocks.csv & smi=$!
AB_ROUNDS=3 timeout 240 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
kill $smi; awk -F', ' 'NR>1 {n++; c+=$2; p+=$3} END {printf "clock samples %d: mean SM %.0f MHz, power %.0f W\n", n, c/n, p/n}' /tmp/clocks.csv | tee $OUT/clocks_summary.txt
