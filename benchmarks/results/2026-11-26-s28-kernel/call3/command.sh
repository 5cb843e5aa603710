# session 28, call 3 (machine of call 2, warm: pdl=0 and pdl=1 variants in its TileLang cache): b=1's kernels on the
# timeline with pdl on / off; the interleaved A/B of pdl (our kernel alone: flushed graph / back to back / eager after a
# flush); the new early-trigger test with MLA_BACKEND_SM90_PDL=0 (main's kernels).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
for v in 1 0; do MLA_BACKEND_SM90_PDL=$v timeout 60 python3 scripts/timeline.py "1,4096,16,1,64;1,4096,128,1,64" 2>&1 | grep "b=1" | sed "s/^/pdl=$v /" | tee -a $OUT/timeline.log; done
S="1,4096,16,1,64;1,4096,128,1,64;16,4096,128,1,64;64,4096,64,2,64;128,16384,16,1,64;128,16384,128,1,64;64,8192,16,1,64,ragged"
AB_ROUNDS=3 timeout 330 python3 scripts/ab_interleave.py "$S" "pdl:" "off:MLA_BACKEND_SM90_PDL=0" 2>&1 | grep "b=" | tee $OUT/ab.log
MLA_BACKEND_SM90_PDL=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k early 2>&1 | grep -E "passed|failed|relative error" | head -8 | tee $OUT/pytest_pdl0.log
