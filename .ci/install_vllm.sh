#!/usr/bin/env bash
# Installs vllm==0.26.0 for the CPU tests of the vLLM plugin (tests/test_vllm_plugin.py) without
# replacing the CPU torch. Called by .ci/run after torch==2.13.0 and the project are installed.
#
# Why not `pip install vllm==0.26.0`: it pins torch==2.11.0 and pulls CUDA 13 libraries, flashinfer,
# cutlass-dsl, ... (measured here: 327 s, 7.9 GB venv), replacing torch 2.13.0+cpu. The tests only
# import vLLM's Python modules (plugin loader, attention registry, MLA classes, config, batch split),
# never its compiled _C ops, so: the wheel without its dependencies (~20 s, 300 MB download), plus
# the small packages those imports need. Measured in a fresh venv with an empty pip cache: 80-95 s,
# +1.0 GB on disk (0.75 GB of it vLLM's unused CUDA extensions).
# Everything stays within .ci/constraints.txt (torch 2.13.0, tilelang 0.1.9, apache-tvm-ffi 0.1.10).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS

"$PY" -m pip install -q --no-deps vllm==0.26.0
# What `import vllm`, vllm.config (VllmConfig/ModelConfig on CPU), vllm.plugins, the attention registry,
# vllm.model_executor.layers.attention.mla_attention and vllm.v1.worker.utils import at module level,
# with vLLM 0.26's own version specifiers: a version already installed (e.g. by the SGLang job) is kept.
"$PY" -m pip install -q -c .ci/constraints.txt \
  "transformers>=5.5.3" "pydantic>=2.12.0" "msgspec" "pyzmq>=25.0.0" "cbor2" "cachetools" "cloudpickle" \
  "pybase64" "py-cpuinfo" "psutil" "regex" "einops" "pillow" "prometheus_client>=0.18.0" "aiohttp>=3.13.3" \
  "requests>=2.26.0" "uvloop" "openai>=2.0.0" "openai-harmony>=0.0.3" "llguidance>=1.7.0,<1.8.0"
# xgrammar's own requirements would upgrade apache-tvm-ffi (which tilelang 0.1.9 pins) and pull triton;
# vLLM only needs it importable, so no dependencies, and an existing install is left alone.
"$PY" -c "import xgrammar" 2>/dev/null || "$PY" -m pip install -q --no-deps "xgrammar==0.2.7"

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
