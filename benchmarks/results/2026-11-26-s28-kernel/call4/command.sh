# session 28, call 4 (machine of calls 2-3, warm; its cache has the pdl=0 variants): pdl = the wait only (no trigger).
# The whole GPU test file (the early-trigger test now with an 8-program writer, so SMs are free for a split that starts
# early) while the A/B shapes precompile; the early-trigger test with MLA_BACKEND_SM90_PDL=0 (main's kernels); the
# interleaved A/B wait / no wait, our kernel alone.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="1,4096,16,1,64;1,4096,128,1,64;16,4096,128,1,64;64,4096,64,2,64;128,16384,16,1,64;128,16384,128,1,64;64,8192,16,1,64,ragged"
(python3 scripts/quick_time.py --shapes "$S" --precompile 3 2>&1 | tail -1 > $OUT/precompile.log) &
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -15 | tee $OUT/pytest_gpu.log
wait; cat $OUT/precompile.log
MLA_BACKEND_SM90_PDL=0 timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k early 2>&1 | grep -E "passed|failed|relative error" | head -8 | tee $OUT/pytest_pdl0.log
AB_ROUNDS=3 timeout 200 python3 scripts/ab_interleave.py "$S" "wait:" "off:MLA_BACKEND_SM90_PDL=0" 2>&1 | grep "b=" | tee $OUT/ab.log
