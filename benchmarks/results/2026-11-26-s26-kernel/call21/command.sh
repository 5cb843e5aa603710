# session 26, call 21 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): the tiled combine adds each term by an
# explicit fma (call 19: its multiply and add were not contracted, unlike the per-row combine's, so the two differed in
# the last bits). GPU tests (the bit-for-bit test of tiled against per-row included), then the combine's time (profiler
# over graph replays) under the default pick and forced per row, on three shapes where the tiled one runs
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 360 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log
tail -3 $OUT/pytest_gpu.log
S="64,4096,64,2,64;128,4096,128,2,64,ragged;128,4096,16,2,64,ragged"
for c in auto row; do MLA_BACKEND_COMBINE=$c timeout 90 python3 scripts/quick_time.py --shapes "$S" --kineto 2>&1 \
  | grep "b=" | sed "s/^/$c /" | tee -a $OUT/kineto.log; done
