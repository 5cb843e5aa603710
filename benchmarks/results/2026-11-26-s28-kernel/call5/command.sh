# session 28, call 5 (machine of calls 2-4, warm): the early-trigger test with a ~1 ms spin before the writer (so the
# host has queued the writer, the split and the combine before the writer runs): main's kernels (MLA_BACKEND_SM90_PDL=0)
# and with the wait (default).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
for v in 0 1; do MLA_BACKEND_SM90_PDL=$v timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k early 2>&1 | grep -E "passed|failed|relative error|^FAILED" | head -8 | sed "s/^/pdl=$v: /" | tee -a $OUT/pytest_early.log; done
