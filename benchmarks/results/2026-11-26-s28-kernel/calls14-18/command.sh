# session 28, calls 14-18 (benchmarks/results moved out of the tree for the carry limit). 14 and 16: carry sglang +
# sgl-kernel + sglang-deps + unpack.sh, `source .devkit/unpack.sh` (call 15, the first try of call 17, lost its
# machine: 'stopped answering'; 16 started a fresh one). 17: carry flashinfer-sgl, tilelang-0.1.11, sgl-ipython,
# sgl-transformers, sgl-extra, sgl-deepgemm + unpack.sh: `MLA_BACKEND_SM90_PDL=0 bash sgl128.sh` (main's kernels);
# 18: carry unpack.sh, `bash sgl128.sh` (the wait). sgl128.sh:
# session 28, calls 15-16: SGLang 0.5.17 teacher-forced at 128 heads (tilelang_mla p64 vs flashmla p64)
mkdir -p /tmp/tiny128 && python3 -c "
import json; c = json.load(open('tests/e2e/tiny_dsv3_sglang/config.json')); c['num_attention_heads'] = c['num_key_value_heads'] = 128
json.dump(c, open('/tmp/tiny128/config.json', 'w'), indent=2)"
echo "MLA_BACKEND_SM90_PDL=${MLA_BACKEND_SM90_PDL:-1 (default)}"
bash scripts/device_sglang.sh e2e --forced --model /tmp/tiny128 --only tilelang_p64_forced --only flashmla_p64_forced --budget 540 2>&1 | grep -v -i warn | tail -30
