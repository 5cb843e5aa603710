# session 24, call 9 (written as call 6, which ran on a fresh machine; calls 7-8 set this one up) (carries vllm-moe + vllm-py + unpack.sh; after calls 4-5 on the same machine): the side-by-side
# bench (bf16 grid with --check, fp8), the h=128 rows again with named_p_ready off, and b=1 in CUDA-graph replay
bash scripts/device_vllm.sh bench
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache
MLA_BACKEND_SM90_NAMEDP=0 timeout 120 python3 -m mla_backend.bench --quick --filter h=128 --out-dir /tmp/b0 2>&1 | grep -v Cache | tail -14 | tee $OUT/bench_namedp0.log
timeout 90 python3 -m mla_backend.bench --quick --graphs --filter b=1 --out-dir /tmp/bg 2>&1 | grep -v Cache | tail -5 | tee $OUT/bench_graphs.log
