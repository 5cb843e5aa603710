# session 29, call 1 (carries tilelang-0.1.9 + unpack.sh; a fresh machine). The change: the plan kernel waits
# (pdl), S's rope WGMMAs from Q in registers (q_rope_regs, MLA_BACKEND_SM90_QREG), the combines' metadata read before
# their wait (combine_meta_early, MLA_BACKEND_SM90_COMBINE_META). The whole GPU test file on it while the A/B's other
# arms precompile; then the plan kernel's early-trigger test with MLA_BACKEND_SM90_PDL=0 (the planner as on main).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="1,4096,16,1,64;1,4096,128,1,64;64,4096,128,1,64;64,8192,64,2,64;128,16384,128,2,64;128,16384,16,1,64;64,8192,16,1,64,ragged"
(python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 > $OUT/precompile_default.log;
 MLA_BACKEND_SM90_QREG=0 python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 > $OUT/precompile_qreg0.log;
 MLA_BACKEND_SM90_COMBINE_META=0 python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 > $OUT/precompile_meta0.log) &
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
MLA_BACKEND_SM90_PDL=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k plan_kernel_waits 2>&1 | grep -E "passed|failed|skipped|Error|assert" | head -8 | tee $OUT/pytest_plan_pdl0.log
wait; cat $OUT/precompile_*.log
