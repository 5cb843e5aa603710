# session 24, call 14 (carries tilelang-0.1.9 + unpack.sh; after calls 12-13 unpacked vllm-c and vllm-deps on the same
# machine): cluster_kv is the default now. GPU tests on it beside the precompiles of the bench's kernels, then
# compute-sanitizer racecheck + memcheck on the sanitizer's h=128 page-64 case (the one the clusters run)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
P="1,4096,16,1,64;128,16384,16,1,16;128,16384,128,1,64;64,8192,128,2,64;128,16384,16,2,64;128,16384,16,1,64,fp8"
python3 scripts/quick_time.py --shapes "$P" --precompile 6 2>&1 | tail -1
for tool in racecheck memcheck; do
  timeout 90 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 3 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -6 | tee $OUT/sanitize_$tool.log
done
wait
tail -3 $OUT/pytest_gpu.log
