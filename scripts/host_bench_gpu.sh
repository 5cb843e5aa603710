#!/usr/bin/env bash
# GPU machine (Hopper, vLLM 0.26 installed): the launcher's tests on the kernel path, then the host-time benchmark.
#   bash scripts/host_bench_gpu.sh [OUT_DIR]        OUT_DIR: default $OUT, else mla_bench_results/host
# Writes to OUT_DIR: gpu.txt, pytest_launcher.txt (tests/test_launcher_gpu.py and tests/test_launcher.py),
# host.json / host.md / bench_host.txt (mla-backend bench --host: host µs p50/p99 over 2000 calls and eager µs per
# call of mla_decode, MLADecodeLauncher, vLLM's FlashMLA and FA3; the per-step plan and vLLM metadata build).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-mla_bench_results/host}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_launcher_gpu.py tests/test_launcher.py 2>&1 \
    | tee "$out/pytest_launcher.txt" | tail -5
tests=${PIPESTATUS[0]}
python3 -m mla_backend.cli bench --host --calls 2000 --out-dir "$out" 2>&1 | tee "$out/bench_host.txt"
bench=${PIPESTATUS[0]}
echo "pytest exit $tests, bench --host exit $bench"
exit $(( tests != 0 || bench != 0 ))
