# session 28, call 19 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): compute-sanitizer memcheck and racecheck on
# the final kernels (with the wait): the sanitizer's page-64 h=128 case (the row-block pairs) and page-64 h=16 (tws)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 scripts/quick_time.py --shapes "1,64,128,1,64;1,64,16,1,64" --precompile 2 2>&1 | tail -1
timeout 60 python3 scripts/sanitize_case.py --cases 3,0 2>&1 | tail -2
for tool in memcheck racecheck; do
  timeout 120 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 3,0 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -8 | sed "s/^/$tool: /" | tee -a $OUT/sanitize.log
done
