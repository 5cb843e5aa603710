#!/usr/bin/env bash
# Installs vllm==0.26.0 for the CPU tests of the vLLM plugin (tests/test_vllm_plugin.py) without
# replacing the CPU torch. Called by .ci/run after torch==2.13.0 and the project are installed.
#
# Why not `pip install vllm==0.26.0`: it pins torch==2.11.0 and pulls CUDA 13 libraries, flashinfer,
# cutlass-dsl, ... (measured here: 327 s, 7.9 GB venv), replacing torch 2.13.0+cpu. The tests only
# import vLLM's Python modules (plugin loader, attention registry, MLA classes, config, batch split),
# never its compiled _C ops, so: the wheel without its dependencies (~20 s, 300 MB download),
# plus the few pure-Python / small-wheel packages those imports need (measured: ~40 s in all).
# Everything stays within .ci/constraints.txt (torch 2.13.0, tilelang 0.1.9, apache-tvm-ffi 0.1.10).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS

"$PY" -m pip install -q --no-deps vllm==0.26.0
# What `import vllm`, vllm.config (VllmConfig/ModelConfig on CPU), vllm.plugins, the attention registry,
# vllm.model_executor.layers.attention.mla_attention and vllm.v1.worker.utils import at module level.
"$PY" -m pip install -q -c .ci/constraints.txt \
  "transformers==5.23.0" "pydantic==2.14.3" "msgspec==0.22.0" "pyzmq==27.3.0" "cbor2==6.2.1" \
  "cachetools==8.0.1" "cloudpickle==3.1.2" "pybase64==1.5.1" "py-cpuinfo==9.0.0" "psutil" "regex" \
  "einops==0.8.2" "pillow" "prometheus_client" "aiohttp" "requests" "uvloop" \
  "openai==3.54.0" "openai-harmony==0.0.8" "llguidance==1.7.6"
# xgrammar's own requirements would upgrade apache-tvm-ffi (which tilelang 0.1.9 pins) and pull triton;
# vLLM only needs it importable.
"$PY" -m pip install -q --no-deps "xgrammar==0.2.7"

"$PY" - <<'EOF'
import torch
import vllm
import vllm.plugins
import vllm.v1.attention.backends.registry
import vllm.model_executor.layers.attention.mla_attention
import vllm.v1.worker.utils
from vllm.config import DeviceConfig, VllmConfig

VllmConfig(device_config=DeviceConfig(device="cpu"))
assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
print(f"vllm {vllm.__version__} importable on CPU with torch {torch.__version__}")
EOF
echo "install_vllm: $((SECONDS - start)) s"
