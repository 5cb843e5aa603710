# session 25, call 9 (carries vllm-moe + vllm-py + unpack.sh; after calls 6-8 on the same machine): the whole bench
# grid (FlashMLA's 128 configs + latency + page sizes) side by side with vLLM's FlashMLA and FA3 (Triton left out
# for time), eager, --check; then the grid rows the pairs run (h=128, h=64 s_q=2) under CLUSTER_ROPE beside the anchors;
# then b=1 in CUDA-graph replay
set -o pipefail
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python3 -m mla_backend.bench --grid full --impls ours,flashmla,fa3 --check --out-dir $OUT/full 2>&1 | grep -v Cache | tail -160 > $OUT/bench_full.log
tail -3 $OUT/bench_full.log
MLA_BACKEND_SM90_CLUSTER_ROPE=1 timeout 150 python3 -m mla_backend.bench --grid flashmla --filter h=128 --filter h=64,s_q=2 --impls ours,flashmla,fa3 --out-dir $OUT/rope 2>&1 | grep -v Cache | tail -60 > $OUT/bench_rope.log
timeout 60 python3 -m mla_backend.bench --quick --graphs --filter b=1 --impls ours,flashmla,fa3 --out-dir /tmp/bg 2>&1 | grep -v Cache | tail -4 | tee $OUT/bench_graphs.log
tar -C $OUT -czf $OUT/bench_files.tgz full rope && rm -rf $OUT/full $OUT/rope
