# session 27, call 3 (carries tilelang-0.1.9 + unpack.sh): at b=64 fixed lengths h=128 (one wave of 128 CTAs, no
# split, as FA3's) are the CTA pairs (TMA multicast, k_free over both CTAs) still a gain? Interleaved A/B of our kernel
# alone, default (pairs) vs MLA_BACKEND_SM90_CLUSTER=0 (each CTA loads every block itself), 4 rounds; b=128 as the
# shape where the pairs were measured a gain (session 24)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="64,4096,128,1,64;64,16384,128,1,64;64,32768,128,1,64;64,8192,64,2,64;64,16384,128,2,64;128,16384,128,1,64"
for v in 1 0; do MLA_BACKEND_SM90_CLUSTER=$v python3 scripts/quick_time.py --shapes "$S" --precompile 8 2>&1 | tail -1 & done; wait
AB_ROUNDS=4 timeout 400 python3 scripts/ab_interleave.py "$S" "pairs:MLA_BACKEND_SM90_CLUSTER=1" "nopairs:MLA_BACKEND_SM90_CLUSTER=0" 2>&1 | grep "^b=" | tee $OUT/ab.log
