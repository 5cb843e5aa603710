# session 27, call 8 (carries tilelang-0.1.9 + unpack.sh): where the ~93 us of host time of one eager call (the
# bench's host_us at b=1; FA3 47, FlashMLA 49) goes, per stage and by cProfile (scripts/host_profile.py)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a $OUT/gpu.txt
timeout 300 python3 scripts/host_profile.py 1 4096 16 1 64 2>&1 | grep -v "Warn\|Composable" | tee $OUT/host_b1.log
timeout 200 python3 scripts/host_profile.py 16 4096 128 1 64 2>&1 | grep -v "Warn\|Composable" | head -14 | tee $OUT/host_b16.log
