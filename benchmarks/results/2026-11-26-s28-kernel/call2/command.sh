# session 28, call 2 (carries tilelang-0.1.9 + unpack.sh; machine of call 1, warm): pdl (griddepcontrol.wait at the top
# of the split and combine kernels, launch_dependents in the split). The whole GPU test file on the change (the new
# test: a predecessor that triggers its dependents at once and writes q ~40 us later), while the A/B's pdl=0 variants
# precompile; then the new test again with MLA_BACKEND_SM90_PDL=0 (the kernels as on main: does the hazard show?).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="1,4096,16,1,64;1,4096,128,1,64;16,4096,128,1,64;64,4096,64,2,64;128,16384,16,1,64;128,16384,128,1,64;64,8192,16,1,64,ragged"
(MLA_BACKEND_SM90_PDL=0 python3 scripts/quick_time.py --shapes "$S" --precompile 4 2>&1 | tail -1 > $OUT/precompile0.log) &
timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
wait; cat $OUT/precompile0.log
MLA_BACKEND_SM90_PDL=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k early 2>&1 | grep -E "passed|failed|relative error|Error" | head -8 | tee $OUT/pytest_pdl0.log
