# session 29, call 6 (machine of calls 1-5, warm): under TileLang 0.1.9, the plan kernel's early-trigger test with
# MLA_BACKEND_SM90_PDL=0 (the planner as before this session), unbuffered, failures named (-rfs; run twice, the first without -f) (calls 3 and 5 lost its output at their
# 90-100 s timeouts: the cython launcher's build is slow).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH PYTHONUNBUFFERED=1
MLA_BACKEND_SM90_PDL=0 timeout 220 python3 -u -m pytest -q -rfs -p no:cacheprovider tests/test_kernel_gpu.py -k "plan_kernel_waits" 2>&1 | grep -E "^E .*(rror|assert)|FAILED|passed|failed|SKIP|Timeout" | head -12 | tee $OUT/pytest_plan_pdl0.log
