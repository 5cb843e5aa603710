# session 27, calls 14-17 (one fresh machine; benchmarks/results moved out of the tree so the bundles fit the 64 MiB
# carry): vLLM 0.26 end to end on main 326548d (the host-path change)
# call 14: carry .devkit/vllm-c.tar.xz + unpack.sh
source .devkit/unpack.sh
# call 15: carry .devkit/vllm-deps.tar.xz, tilelang-0.1.9.tar.xz + unpack.sh
source .devkit/unpack.sh
# call 16: carry .devkit/vllm-moe.tar.xz, vllm-py.tar.xz + unpack.sh
bash scripts/device_vllm.sh e2e              # block64 (block16 skipped by the budget) -> call16_vllm_block64.json
# call 17: carry unpack.sh
bash scripts/device_vllm.sh e2e verify,forced  # -> call17_vllm_verify_forced.json
