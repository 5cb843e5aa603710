# session 25, call 4 (carries vllm-moe + vllm-py + unpack.sh; after calls 1-3 on the same machine): the whole bench
# grid (FlashMLA's 128 configs + latency + page sizes) side by side with vLLM's FlashMLA and FA3 (Triton left out
# for time), eager, --check; then the quick grid's h=128 rows under CLUSTER_ROPE + CLUSTER_MIX beside the anchors;
# then b=1 in CUDA-graph replay
set -o pipefail
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 -m mla_backend.bench --grid full --impls ours,flashmla,fa3 --check --out-dir $OUT/full 2>&1 | grep -v Cache | tail -160 > $OUT/bench_full.log
tail -3 $OUT/bench_full.log
MLA_BACKEND_SM90_CLUSTER_ROPE=1 MLA_BACKEND_SM90_CLUSTER_MIX=1 timeout 100 python3 -m mla_backend.bench --quick --filter h=128 --impls ours,flashmla,fa3 --out-dir $OUT/both 2>&1 | grep -v Cache | tail -12 | tee $OUT/bench_both.log
timeout 60 python3 -m mla_backend.bench --quick --graphs --filter b=1 --impls ours,flashmla,fa3 --out-dir /tmp/bg 2>&1 | grep -v Cache | tail -4 | tee $OUT/bench_graphs.log
tar -C $OUT -czf $OUT/bench_files.tgz full both && rm -rf $OUT/full $OUT/both
