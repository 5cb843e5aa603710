# session 24, call 5 (carries vllm-deps + tilelang-0.1.9 + unpack.sh; after call 4 on the same machine): GPU tests on
# the final tree beside the precompiles of the bench's kernels (default, and named_p_ready off for the h=128 rows),
# then compute-sanitizer racecheck + memcheck on the h=128 and h=32 e4m3 sanitizer cases
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
P="1,4096,16,1,64;128,16384,16,1,16;128,16384,128,1,64;64,8192,128,2,64;128,16384,16,2,64;128,16384,16,1,64,fp8"
python3 scripts/quick_time.py --shapes "$P" --precompile 6 2>&1 | tail -1 &
MLA_BACKEND_SM90_NAMEDP=0 python3 scripts/quick_time.py --shapes "128,16384,128,1,64;64,8192,128,2,64" --precompile 2 2>&1 | tail -1 &
timeout 200 python3 scripts/sanitize_case.py --cases 2,3,5 2>&1 | grep -v Cache | tee $OUT/sanitize_plain.log
for tool in racecheck memcheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 2,3,5 2>&1 \
    | grep -v "Cache\|Host Frame\|WARNING" | tail -20 | tee $OUT/sanitize_$tool.log
done
wait
tail -3 $OUT/pytest_gpu.log
