#!/usr/bin/env bash
# CI, optional: what the gfx942 checks need beyond the main install (tests/test_hip_codegen.py).
# - TileLang 0.1.11 (SGLang's pin) in a side directory: its PyPI wheel has HIP codegen, 0.1.9's (vLLM's
#   pin, the main install) does not. --no-deps: its other requirements are already installed.
# - Debian's clang-19, HIP 5.2 headers and ROCm device libs, to try compiling the HIP for gfx942
#   (root + apt only; skipped otherwise).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q --no-deps --target .ci/tilelang-hip tilelang==0.1.11 apache-tvm-ffi==0.1.11 \
  torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0 || echo "tilelang 0.1.11 side install failed: HIP codegen test will skip"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -q --no-install-recommends clang-19 libamdhip64-dev rocm-device-libs >/dev/null 2>&1 ||
   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends clang-19 libamdhip64-dev \
    rocm-device-libs >/dev/null 2>&1)) || echo "clang-19 / HIP headers not installed: the compile step will skip"
fi
exit 0
