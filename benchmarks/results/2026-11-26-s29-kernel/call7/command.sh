# session 29, call 7 (a fresh machine; carries tilelang-0.1.9 + unpack.sh): the wide combine with per-warp LSE
# reductions by shuffles (wide_warp_lse, MLA_BACKEND_SM90_WIDE_WARP). Precompile the tests' and the A/B's variants,
# the combine GPU tests (and the early-trigger ones), then the interleaved A/B against the block-wide wide combine
# (MLA_BACKEND_SM90_WIDE_WARP=0) at the shapes that take the wide combine, and b=1's kernel timeline for both.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 scripts/quick_time.py --shapes "1,4096,16,1,64;1,4096,128,1,64;1,4096,128,2,64;1,4096,1,1,64;1,4096,16,3,16" --precompile 5 2>&1 | tail -1 | tee $OUT/precompile.log
MLA_BACKEND_SM90_WIDE_WARP=0 python3 scripts/quick_time.py --shapes "1,4096,16,1,64" --precompile 1 2>&1 | tail -1 | tee -a $OUT/precompile.log
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "combine or early or graph" 2>&1 | grep -E "^E .*(rror|assert)|FAILED|passed|failed" | tail -12 | tee $OUT/pytest_gpu.log
S="1,4096,16,1,64;1,1024,16,1,64;1,16384,16,1,64;2,4096,16,1,64"
AB_ROUNDS=5 timeout 120 python3 scripts/ab_interleave.py "$S" "warp:" "block:MLA_BACKEND_SM90_WIDE_WARP=0" 2>&1 | grep "b=" | tee $OUT/ab.log
for w in 1 0; do MLA_BACKEND_SM90_WIDE_WARP=$w timeout 50 python3 scripts/timeline.py "1,4096,16,1,64" 2>&1 | grep "us" | sed "s/^/wide_warp=$w: /" | tee -a $OUT/timeline.log; done
