# session 26, call 9 (carries tilelang-0.1.9 + unpack.sh; the machine of calls 7-8): the tiled combine as the default
# from 2048 rows in all, column-chunked below 64 rows (call 6). GPU tests (graph replay now also at 24 x 128 and 160 x 16
# rows: the tiled combine) beside the
# bench's precompiles, then compute-sanitizer memcheck and racecheck with the tiled combine forced on the sanitizer's
# h=16 and h=128 page-64 cases (a request of six parts, an empty one; h=16: the column-chunked tiled combine)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
(timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
G=""; for h in 16 32 64 128; do for q in 1 2; do G="$G;1,4096,$h,$q,64"; done; done
G="${G#;};1,4096,16,1,1;1,4096,16,1,16;1,4096,128,1,1;1,4096,128,1,16;1,4096,16,1,64,fp8;1,4096,16,1,16,fp8"
python3 scripts/quick_time.py --shapes "$G" --precompile 8 2>&1 | tail -1
for c in tiled; do for tool in memcheck racecheck; do
  MLA_BACKEND_COMBINE=$c timeout 150 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 0,3 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -8 | sed "s/^/$c $tool: /" | tee -a $OUT/sanitize.log
done; done
wait
tail -3 $OUT/pytest_gpu.log
