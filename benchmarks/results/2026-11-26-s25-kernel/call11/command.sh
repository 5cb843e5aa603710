# session 25, call 11 (carries tilelang-0.1.9 + unpack.sh): compute-sanitizer racecheck alone on the sanitizer's
# h=128 page-64 case with cluster_rope the default (call 10's racecheck ran beside the GPU tests and hit its timeout)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 compute-sanitizer --tool racecheck --print-limit 10 python3 scripts/sanitize_case.py --cases 3 2>&1 \
  | grep -E "rel err|SUMMARY|hazard" | tail -6 | tee $OUT/sanitize_racecheck.log
