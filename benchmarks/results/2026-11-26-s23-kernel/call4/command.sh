# session 23, call 4 (after call 3 unpacked vllm-c; carries vllm-deps + tilelang-0.1.9): precompile the bench's and the
# sanitizer cases' kernels, then compute-sanitizer racecheck + memcheck on the cases whose kernels run the new WG0 order
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
P="1,4096,16,1,64;128,16384,16,1,16;128,16384,128,1,64;64,8192,128,2,64;128,16384,16,2,64;128,16384,16,1,64,fp8"
python3 scripts/quick_time.py --shapes "$P" --precompile 6 2>&1 | tail -1 &
timeout 200 python3 scripts/sanitize_case.py --cases 2,3,5 2>&1 | grep -v Cache | tee $OUT/sanitize_plain.log
for tool in racecheck memcheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 2,3,5 2>&1 \
    | grep -v "Cache\|Host Frame\|WARNING" | tail -20 | tee $OUT/sanitize_$tool.log
done
wait
