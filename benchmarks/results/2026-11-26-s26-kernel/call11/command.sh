# session 26, call 11 (carries unpack.sh only; the machine of calls 7-10, where vLLM 0.26 and TileLang are unpacked and
# the package installed): vLLM end to end with the tiled combine forced (MLA_BACKEND_COMBINE=tiled, inherited by the
# engines): the "verify" case (CUSTOM, eager, block 16: every decode call recomputed by the fp32 reference inside the
# engine) with 160 prompts of 1-600 tokens and max-num-seqs 160, so decode batches reach 160 x 16 rows
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1 MLA_BACKEND_COMBINE=tiled
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
L=$(python3 -c "import random; r = random.Random(5); print(','.join(str(r.randint(1, 600)) for _ in range(160)))")
timeout 560 python3 tests/e2e/vllm_e2e.py --cases verify --prompt-lens "$L" --max-num-seqs 160 --max-tokens 32 \
  --budget 520 --out $OUT/vllm_verify_b160.json 2>&1 | grep -v -i "warn" | tail -30 | tee $OUT/vllm_verify.log
rm -rf $OUT/vllm_verify_b160-logs
