# session 27, call 10 (carries tilelang-0.1.9 + unpack.sh): the final settings path (env_fingerprint, config_for read
# once per call): host time per stage, the whole call against the earlier settings path in the same process (rounds
# interleaved; scripts/host_profile.py), and the bench's b=1 / b=16 latency rows for ours (eager; host_us column)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for c in "1 4096 16 1 64" "16 4096 128 1 64"; do
  timeout 200 python3 scripts/host_profile.py $c 2>&1 | grep -v "Warn\|Composable\|TileLang" | grep -v "^ *[0-9]* *0\.0\|function calls\|Ordered by\|List reduced\|ncalls" | head -14 | tee -a $OUT/host.log
done
timeout 150 python3 -m mla_backend.cli bench --grid latency --impls ours --out-dir $OUT/bench 2>&1 | grep -v "Warn\|Composable\|TileLang" | tail -8
python3 -c "
import csv
for r in csv.DictReader(open('$OUT/bench/bench.csv')): print(r['label'], round(float(r['us']), 1), 'us, host', round(float(r['host_us']), 1), 'us')" | tee $OUT/host_us.txt
