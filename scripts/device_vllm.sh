#!/bin/bash
# GPU machine, vLLM 0.26 sequence (../shared/devkit/README.md): calls 1 and 2 only unpack bundles
# (`source .devkit/unpack.sh`); call 3+ run `bash scripts/device_vllm.sh STAGE` carrying
# .devkit/vllm-deps.tar.xz, .devkit/tilelang-0.1.9.tar.xz and .devkit/unpack.sh.
#   kernel  GPU kernel tests + side-by-side benchmark (--quick, FlashMLA / FA3 / Triton anchors)
#   tests   GPU kernel tests only
#   e2e     vLLM E2E cases given as $2 (default block64,block16); $E2E_ARGS: more vllm_e2e.py options (--heads 128)
#   serve   vllm serve over HTTP; throughput  decode-heavy tokens/s vs FLASHMLA and FLASH_ATTN_MLA
# Split so that each call stays under 64 MiB and 10 minutes (session 7):
#   1. carry vllm-c: `source .devkit/unpack.sh`
#   2. carry tilelang-0.1.9 + vllm-deps: `bash scripts/device_vllm.sh kernel-tests` (needs only TileLang: GPU
#      tests, the opt-in tws kernel's smoke + fp8 A/B, small-batch split/combine times)
#   3. carry vllm-moe + vllm-py + flashinfer: `bash scripts/device_vllm.sh bench` (side by side, bf16 + fp8)
set -o pipefail
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1
# Engines find plugins through installed entry points: install the package (no deps) every call.
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
python3 -c "from importlib.metadata import entry_points as e; print('entry points:', list(e(group='vllm.general_plugins')))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
case "$1" in
  kernel-tests)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -25 | tee $OUT/pytest_gpu.log
    MLA_BACKEND_SM90_KERNEL=tws timeout 60 python3 scripts/quick_time.py --smoke 2>&1 | tail -3 | tee $OUT/smoke_tws.log
    for k in tws ws; do
      MLA_BACKEND_SM90_KERNEL=$k timeout 90 python3 scripts/quick_time.py --fp8 --cases 0,1 2>&1 | grep -v Cache | tee -a $OUT/quick_time_fp8.log
    done
    timeout 120 python3 scripts/tune_small.py 2>&1 | grep -v Cache | tee $OUT/tune_small.log ;;
  bench)
    timeout 300 python3 -m mla_backend.bench --quick --check --out-dir $OUT/bench 2>&1 | tail -60 | tee $OUT/bench.log
    timeout 150 python3 -m mla_backend.bench --quick --fp8 --filter h=16,s_q=1 --out-dir $OUT/bench_fp8 2>&1 | tail -30 | tee $OUT/bench_fp8.log
    tar -C $OUT -czf $OUT/bench_files.tgz bench bench_fp8 && rm -rf $OUT/bench $OUT/bench_fp8 ;;  # <= 8 files come back
  tests) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -25 | tee $OUT/pytest_gpu.log ;;
  kernel)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -25 | tee $OUT/pytest_gpu.log
    timeout 250 python3 -m mla_backend.bench --quick --check --out-dir $OUT/bench 2>&1 | tail -60 | tee $OUT/bench.log
    timeout 110 python3 -m mla_backend.bench --quick --fp8 --filter h=16,s_q=1 --out-dir $OUT/bench_fp8 2>&1 | tail -30 | tee $OUT/bench_fp8.log ;;
  e2e) timeout 590 python3 tests/e2e/vllm_e2e.py --budget 560 --cases "${2:-block64,block16}" ${E2E_ARGS:-} --out $OUT/vllm_e2e.json 2>&1 | tail -60 ;;
  serve) timeout 560 python3 tests/e2e/vllm_e2e.py --serve --out $OUT/vllm_serve.json 2>&1 | tail -40 ;;
  throughput) timeout 560 python3 tests/e2e/vllm_e2e.py --throughput --tp-prompts ${2:-256} --out $OUT/vllm_tput.json 2>&1 | tail -40 ;;
esac
