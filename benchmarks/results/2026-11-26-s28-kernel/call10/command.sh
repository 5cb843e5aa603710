# session 28, call 10 (carries tilelang-0.1.9 + unpack.sh): the eager effect of the wait (the kernels that wait are
# launched with programmatic stream serialisation allowed, so each may start as its predecessor's programs exit):
# the bench's latency rows for ours alone, with and without the wait, twice each, alternating; then b=1's timeline.
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="1,4096,16,1,64;1,4096,128,1,64"
for v in 0 1; do MLA_BACKEND_SM90_PDL=$v python3 scripts/quick_time.py --shapes "$S" --precompile 2 2>&1 | tail -1 & done; wait
for r in 1 2; do for v in 1 0; do
  MLA_BACKEND_SM90_PDL=$v timeout 100 python3 -m mla_backend.cli bench --grid latency --impls ours --out-dir $OUT/bench_pdl${v}_$r 2>&1 | grep -v "Warn\|Composable\|TileLang" | tail -1 > /dev/null
  python3 -c "
import csv
for x in csv.DictReader(open('$OUT/bench_pdl${v}_$r/bench.csv')): print('pdl=$v round $r', x['label'], round(float(x['us']), 2), 'us')" | tee -a $OUT/latency.log
done; done
for v in 1 0; do MLA_BACKEND_SM90_PDL=$v timeout 60 python3 scripts/timeline.py "$S" 2>&1 | grep "b=1" | sed "s/^/pdl=$v /" | tee -a $OUT/timeline.log; done
tar -C $OUT -czf $OUT/bench_files.tgz $(cd $OUT && ls -d bench_pdl*) && rm -rf $OUT/bench_pdl*
