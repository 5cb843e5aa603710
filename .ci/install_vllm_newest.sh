#!/usr/bin/env bash
# Installs the newest vLLM this plugin claims (pyproject's `vllm` extra upper end, CPU-checked only) in a side
# directory, .ci/vllm-newest, for a second run of tests/test_vllm_plugin.py with PYTHONPATH=.ci/vllm-newest
# (it shadows the 0.26.0 of .ci/install_vllm.sh, which the main run uses). Called after install_vllm.sh.
#
# The wheel without dependencies, as in install_vllm.sh (it pins torch 2.14, tilelang 0.1.12: not wanted
# here); the main install already has what its Python modules import except fastapi / starlette /
# partial-json-parser (pure Python). Its compiled _C ops are never called by these tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${VLLM_NEWEST_SITE:-.ci/vllm-newest}
VERSION=${VLLM_NEWEST_VERSION:-0.33.0}
start=$SECONDS

rm -rf "$SITE"
"$PY" -m pip install -q --no-deps --target "$SITE" "vllm==$VERSION" "fastapi==0.136.3" "starlette==1.10.0" \
  "partial-json-parser==0.2.1.1.post7"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import torch
import vllm
import vllm.v1.attention.backends.registry

assert torch.__version__.startswith("2.13.0"), f"torch was replaced: {torch.__version__}"
print(f"vllm {vllm.__version__} importable on CPU with torch {torch.__version__} (side directory)")
PYEOF
echo "install_vllm_newest: $((SECONDS - start)) s, $(du -sh "$SITE" | cut -f1)"
