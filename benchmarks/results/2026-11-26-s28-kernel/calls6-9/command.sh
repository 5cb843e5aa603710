# session 28, calls 6-9 (a fresh machine; benchmarks/results moved out of the tree for the carry limit):
# 6: carry vllm-c + unpack.sh: `source .devkit/unpack.sh`
# 7: carry vllm-deps + tilelang-0.1.9 + unpack.sh: `source .devkit/unpack.sh`
# 8: carry vllm-moe + vllm-py + unpack.sh: main's kernels (no wait), the tiny model at 128 heads (the row-block pairs):
MLA_BACKEND_SM90_PDL=0 E2E_ARGS="--heads 128" bash scripts/device_vllm.sh e2e forced
# 9: carry unpack.sh: the kernels with the wait (default), 128 heads:
E2E_ARGS="--heads 128" bash scripts/device_vllm.sh e2e verify,forced
