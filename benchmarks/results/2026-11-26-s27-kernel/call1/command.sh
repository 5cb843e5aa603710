# session 27, call 1 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): cluster_gather, the row-block CTA pairs
# below page 64 (each CTA gathers half of every block, then copies it into the other's shared memory). Precompile both
# settings, the GPU tests that run the pairs below page 64 with it on, the interleaved A/B of our kernel alone
# (page 16 / 1 / 32 at h=128, page 16 at h=128 and h=64 s_q=2; page 64 as the control), then compute-sanitizer
# memcheck and racecheck on the sanitizer's page-16 h=128 s_q=2 case with it on.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,16;128,16384,128,1,1;128,16384,128,1,32;64,8192,128,2,16;64,8192,64,2,16;128,16384,128,1,64"
for v in 1 0; do MLA_BACKEND_SM90_CLUSTER_GATHER=$v python3 scripts/quick_time.py --shapes "$S" --precompile 8 2>&1 | tail -1 & done; wait
export MLA_BACKEND_SM90_CLUSTER_GATHER=1
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "pairs_below or mtp_causal or graph_replay" 2>&1 | tail -15 | tee $OUT/pytest_pairs.log
AB_ROUNDS=3 timeout 200 python3 scripts/ab_interleave.py "$S" "base:MLA_BACKEND_SM90_CLUSTER_GATHER=0" "pair:MLA_BACKEND_SM90_CLUSTER_GATHER=1" 2>&1 | grep -v Warn | tee $OUT/ab.log
timeout 60 python3 scripts/sanitize_case.py --cases 2 2>&1 | tail -2
for tool in memcheck racecheck; do
  timeout 100 compute-sanitizer --tool $tool --print-limit 10 python3 scripts/sanitize_case.py --cases 2 2>&1 \
    | grep -E "rel err|SUMMARY|Invalid|hazard" | tail -8 | sed "s/^/$tool: /" | tee -a $OUT/sanitize.log
done
