# session 29, call 3 (machine of calls 1-2, warm; its cache has all three arms' variants). The early-trigger tests with
# the test's copy fixed (call 1-2: NameError in the test's TileLang copy, not a kernel failure); the plan kernel's test
# with MLA_BACKEND_SM90_PDL=0 (main's planner: no wait); then the interleaved A/B, our kernel alone: this session's
# kernels against each switch off; then b=1's kernel timeline with and without the combines' early metadata.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "early" 2>&1 | grep -E "^E .*(rror|assert)|FAILED|passed|failed|skipped" | head -20 | tee $OUT/pytest_early.log
MLA_BACKEND_SM90_PDL=0 timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernel_gpu.py -k "plan_kernel_waits" 2>&1 | grep -E "^E .*(rror|assert)|FAILED|passed|failed|SKIP" | head -10 | tee $OUT/pytest_plan_pdl0.log
S="1,4096,16,1,64;1,4096,128,1,64;64,4096,128,1,64;64,8192,64,2,64;128,16384,128,2,64;128,16384,16,1,64;64,8192,16,1,64,ragged"
AB_ROUNDS=3 timeout 260 python3 scripts/ab_interleave.py "$S" "new:" "qreg0:MLA_BACKEND_SM90_QREG=0" "meta0:MLA_BACKEND_SM90_COMBINE_META=0" 2>&1 | grep "b=" | tee $OUT/ab.log
for m in 1 0; do MLA_BACKEND_SM90_COMBINE_META=$m timeout 60 python3 scripts/timeline.py "1,4096,16,1,64;1,1024,16,1,64" 2>&1 | grep "us" | sed "s/^/meta=$m: /" | tee -a $OUT/timeline.log; done
