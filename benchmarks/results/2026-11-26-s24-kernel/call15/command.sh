# session 24, call 15 (carries vllm-moe + vllm-py + unpack.sh; after calls 12-14 on the same machine): the side-by-side
# bench with cluster_kv (bf16 grid with --check, fp8), and b=1 in CUDA-graph replay
bash scripts/device_vllm.sh bench
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache
timeout 90 python3 -m mla_backend.bench --quick --graphs --filter b=1 --out-dir /tmp/bg 2>&1 | grep -v Cache | tail -5 | tee $OUT/bench_graphs.log
