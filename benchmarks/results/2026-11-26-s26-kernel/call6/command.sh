# session 26, call 6 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): the tiled combine below 64 rows as four
# programs per 16-row tile (128 columns each). The combine GPU tests, then an interleaved A/B of the combine forced
# tiled / per row (our kernel alone) where rows < 64, idle (fixed lengths) and with work (ragged), and the kernels' own
# times (profiler over graph replays)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="64,4096,16,1,64;128,4096,16,1,64;128,4096,32,1,64;64,4096,16,2,64;64,8192,16,1,64,ragged"
S="$S;128,16384,16,1,64,ragged;32,4096,32,1,64,ragged;128,4096,16,2,64,ragged;64,4096,32,1,64,ragged"
S="$S;256,2048,16,1,64,ragged;64,4096,64,1,64,ragged"
python3 scripts/quick_time.py --shapes "$S" --precompile 8 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "combine" 2>&1 | tail -4 | tee $OUT/pytest_gpu.log
SET="tiled:MLA_BACKEND_COMBINE=tiled row:MLA_BACKEND_COMBINE=row"
AB_ROUNDS=3 timeout 200 python3 scripts/ab_interleave.py "$S" $SET 2>&1 | grep "b=" | tee $OUT/interleave.log
for c in tiled row; do MLA_BACKEND_COMBINE=$c timeout 60 python3 scripts/quick_time.py --shapes "$S" --kineto 2>&1 \
  | grep "b=" | sed "s/^/$c /" | tee -a $OUT/kineto.log; done
