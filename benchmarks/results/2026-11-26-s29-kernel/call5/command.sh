# session 29, call 5 (machine of calls 1-4, warm; carries tilelang-0.1.11, SGLang's pin, unpacked apart from 0.1.9):
# main's kernels (this session's experiments reverted) with the plan kernel's wait. The whole GPU test file under
# TileLang 0.1.11 (not run in session 28), then, under 0.1.9, the plan kernel's early-trigger test with
# MLA_BACKEND_SM90_PDL=0 (the planner as before this session: does the test catch a planner that does not wait?).
mkdir -p /tmp/site11 && tar -C /tmp/site11 -xJf .devkit/tilelang-0.1.11.tar.xz
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
PYTHONPATH=/tmp/site11:$PWD:$PYTHONPATH TILELANG_CACHE_DIR=/tmp/tlcache11 python3 -c "import tilelang; print('tilelang', tilelang.__version__)" 2>&1 | tail -1 | tee $OUT/version.txt
PYTHONPATH=/tmp/site11:$PWD:$PYTHONPATH TILELANG_CACHE_DIR=/tmp/tlcache11 timeout 470 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | grep -E "^E .*(rror|assert)|FAILED|passed|failed" | tail -20 | tee $OUT/pytest_gpu_0111.log
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH TILELANG_CACHE_DIR=/tmp/tlcache
MLA_BACKEND_SM90_PDL=0 timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernel_gpu.py -k "plan_kernel_waits" > $OUT/pytest_plan_pdl0.txt 2>&1; tail -5 $OUT/pytest_plan_pdl0.txt
