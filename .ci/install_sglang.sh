#!/usr/bin/env bash
# Installs sglang==0.5.23's Python package in a side directory (.ci/sglang-site, like .ci/tilelang-hip) for
# the CPU tests of the SGLang plugin (tests/test_sglang_plugin.py), which .ci/run then runs with
# PYTHONPATH=.ci/sglang-site. Called after torch==2.13.0, the project and .ci/install_vllm.sh.
#
# Why not `pip install sglang`: 0.5.23 pins torch==2.14.1, tilelang==0.1.12, apache-tvm-ffi==0.1.11,
# flashinfer, sglang-kernel, cutlass-dsl, ... (CUDA), which would replace the CPU torch and the versions in
# .ci/constraints.txt. The tests only import SGLang's Python modules (plugin loader, attention registry,
# server args / CLI, attention base class, ForwardBatch, DeepSeek-V2 dispatch, Triton backend module), never
# its compiled kernels, so: the wheel without dependencies, plus what those imports need at module level
# that the main install (project + vLLM job) lacks. All of it goes to the side directory, so the main
# environment, and the vLLM tests that run in it, see none of it:
# - triton 3.7.1 (torch 2.13's pairing): sglang.srt.utils imports it unconditionally; importing it needs
#   no GPU.
# - torchvision 0.28.0 (torch 2.13's pairing): sglang.srt.configs imports torchvision.transforms. PyPI has
#   only its CUDA build for Linux, whose C extension cannot load with the CPU torch; the test defines the
#   two op schemas its import registers fake kernels for (see tests/test_sglang_plugin.py).
# - starlette, fastapi, uvicorn, opentelemetry-api (fastapi's telemetry), dill, sentencepiece,
#   compressed-tensors, loguru, gguf, partial_json_parser, ipython + traitlets, orjson, setproctitle (the
#   scheduler module, whose get_internal_state serve-bench's SGLang host timers extend): small wheels.
# transformers, pydantic, msgspec, pyzmq, ... come from the main install (vLLM job); SGLang's pins
# (transformers 5.19.0, tilelang 0.1.12, apache-tvm-ffi 0.1.11) are not needed for these imports.
# Measured here in a fresh venv after the vLLM job (2 shared cores, empty pip cache, local index mirrors):
# 43 s, +0.96 GB in .ci/sglang-site (sglang 0.2 GB, triton most of the rest).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${SGLANG_SITE:-.ci/sglang-site}
start=$SECONDS

rm -rf "$SITE"
"$PY" -m pip install -q --no-deps --target "$SITE" \
  "sglang==0.5.23" "triton==3.7.1" "torchvision==0.28.0" \
  "starlette==1.10.0" "fastapi==0.165.0" "uvicorn==0.54.0" "opentelemetry-api==1.45.2" "dill==0.4.1" \
  "sentencepiece==0.2.3" "compressed-tensors==0.20.0" "loguru==0.7.3" "gguf==0.19.0" \
  "partial_json_parser==0.2.1.1.post7" "orjson==3.13.0" "ipython==9.18.1" "traitlets==5.16.1" \
  "setproctitle==1.3.8"

PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import sys

sys.path.insert(0, "tests")
from sglang_cpu_env import prepare_cpu_torchvision  # noqa: E402

prepare_cpu_torchvision()
import torch
import tilelang
import sglang
import sglang.srt.layers.attention.attention_registry
import sglang.srt.layers.attention.base_attn_backend
import sglang.srt.model_executor.forward_batch_info
import sglang.srt.models.deepseek_v2
import sglang.srt.plugins
import sglang.srt.server_args

assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
print(f"sglang {sglang.__version__} importable on CPU with torch {torch.__version__}, tilelang {tilelang.__version__}")
EOF
echo "install_sglang: $((SECONDS - start)) s, $(du -sh "$SITE" | cut -f1)"
