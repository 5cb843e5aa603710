# session 29, call 2 (machine of call 1, warm): why the early-trigger tests failed in call 1. The tests' own output,
# then the same tests with each of the session's switches off.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "early and (16-1 or tvm_ffi)" 2>&1 | grep -v "INFO\|TileLang begins\|TileLang completes" | grep -E "Error|error|assert|FAILED|passed|failed|^E " | head -40 | tee $OUT/pytest_early.log
for sw in MLA_BACKEND_SM90_COMBINE_META MLA_BACKEND_SM90_QREG; do
  env $sw=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "early and (16-1 or 128-1)" 2>&1 | grep -E "passed|failed|^E .*error" | head -6 | sed "s/^/$sw=0: /" | tee -a $OUT/pytest_bisect.log
done
