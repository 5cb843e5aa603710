# session 26, call 20 (carries vllm-moe + vllm-py + unpack.sh; the machine of calls 17-19): vLLM end to end, the
# "graphs" case (CUSTOM with full CUDA graphs vs CUSTOM with attention outside graphs: identical tokens required) with
# 160 prompts of 1-600 tokens and max-num-seqs 160, default combine choice: decode steps of 128+ requests (2048+ rows)
# run the tiled combine inside the captured graphs, smaller ones the per-row combine; call 16 (before the tiled combine
# summed in part order) matched 93.8% of the tokens, not all
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
L=$(python3 -c "import random; r = random.Random(5); print(','.join(str(r.randint(1, 600)) for _ in range(160)))")
timeout 570 python3 tests/e2e/vllm_e2e.py --cases graphs --prompt-lens "$L" --max-num-seqs 160 --max-tokens 32 \
  --budget 540 --out $OUT/vllm_graphs_b160.json 2>&1 | grep -v -i "warn" | grep -v "^ *[0-9]* *[0-9.]*% " | tail -20 \
  | tee $OUT/vllm_graphs.log
rm -rf $OUT/vllm_graphs_b160-logs
