# session 26, call 1 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): the tiled combine (16 rows per program).
# GPU tests (every combine forced on one plan, the auto pick) beside the A/B shapes' precompiles; then an interleaved
# A/B of the combine choice, our kernel alone: auto (tiled from 1024 rows in all) / row (one program per row) /
# grouped (16 rows per program, walked one by one: session 23's pick where parts <= batch and >= 4096 rows);
# then the split and combine kernels' own times (profiler over graph replays) under auto and row.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="64,4096,64,2,64;64,4096,128,1,64;64,4096,64,2,64,ragged;64,8192,128,1,64,ragged;128,4096,32,1,64"
S="$S;128,16384,16,1,64,ragged;64,8192,16,1,64,ragged;128,4096,128,2,64;128,16384,128,2,64,ragged"
S="$S;16,16384,128,1,64;32,4096,32,1,64,ragged;128,8192,64,1,64"
(timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -30 > $OUT/pytest_gpu.log) &
python3 scripts/quick_time.py --shapes "$S" --precompile 6 2>&1 | tail -1
wait
tail -3 $OUT/pytest_gpu.log
SET="auto: row:MLA_BACKEND_COMBINE=row grouped:MLA_BACKEND_COMBINE=grouped"
AB_ROUNDS=3 timeout 200 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
for c in auto row; do MLA_BACKEND_COMBINE=$c timeout 60 python3 scripts/quick_time.py --shapes "$S" --kineto 2>&1 \
  | grep "b=" | sed "s/^/$c /" | tee -a $OUT/kineto.log; done
