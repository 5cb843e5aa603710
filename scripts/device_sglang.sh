#!/bin/bash
# GPU machine, SGLang 0.5.17 sequence (../shared/devkit/README.md): call 1 carries .devkit/sglang,
# sgl-kernel, sglang-deps + unpack.sh and runs `source .devkit/unpack.sh`; call 2+ carry flashinfer-sgl,
# tilelang-0.1.11, sgl-ipython, sgl-transformers, sgl-extra (soundfile + cffi: launch_server imports them;
# `../shared/devkit/pack.sh sgl-extra -- soundfile==0.13.1 cffi==2.0.0 pycparser==2.23`), sgl-deepgemm
# (`pack.sh sgl-deepgemm -- sgl-deep-gemm==0.1.5.post1`: SGLang's EAGLE v2 draft graph capture imports
# dsa_backend, which imports deep_gemm; without it --mtp fails for every attention backend) + unpack.sh
# and run `bash scripts/device_sglang.sh STAGE`.
#   unit    kernel GPU tests under TileLang 0.1.11 (SGLang's pin) + SGLang's attention unit kit
#   e2e     Engine: tilelang_mla vs triton (page 1) and flashmla (page 64); extra args pass through
# The first engine on a fresh machine starts ~170 s slower (cold TileLang and Triton caches; session 6):
# run `e2e --forced ...` first, then `e2e --throughput` on the same warm machine, so all three engines fit.
#   warm    (first call: carry sglang, sgl-kernel, tilelang-0.1.11 + unpack.sh) compile the tiny model's kernel
#           variant with TileLang 0.1.11 into the disk cache, so that the next call's engines start warm, and
#           check it against the fp32 reference (quick_time --smoke); then call 2 carries the rest
# A machine that ran the vLLM sequence first keeps its /tmp/site as /tmp/site-vllm (moved here, not mixed).
set -o pipefail
[ -e /tmp/site/.unpacked-vllm-c ] && mv /tmp/site /tmp/site-vllm
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache011 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
stage=$1; shift
if [ "$stage" = warm ]; then
  timeout 400 python3 -c "
import torch, tilelang
from mla_backend.kernels.runtime import warmup
print('tilelang', tilelang.__version__, 'warm-up', round(warmup([(16, 1, 64, torch.bfloat16, torch.bfloat16, 'sm90')]), 1), 's')" 2>&1 | grep -v Cache | tail -5
  # the same variant against the fp32 reference under SGLang's TileLang (ragged, NaN-poisoned output)
  timeout 120 python3 scripts/quick_time.py --smoke 2>&1 | tail -3
  exit
fi
python3 -c "from importlib.metadata import entry_points as e; print('entry points:', list(e(group='sglang.srt.plugins')))"
python3 -c "import tilelang, sglang; print('tilelang', tilelang.__version__, 'sglang', sglang.__version__)"
case "$stage" in
  unit)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -15 | tee $OUT/pytest_gpu_tl011.log
    timeout 330 python3 tests/e2e/sglang_unit.py --out $OUT/sglang_unit.json "$@" 2>&1 | tail -40 ;;
  e2e) timeout 590 python3 tests/e2e/sglang_e2e.py --out $OUT/sglang_e2e.json "$@" 2>&1 | tail -60 ;;
esac
