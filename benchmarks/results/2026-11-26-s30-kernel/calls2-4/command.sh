# session 30, calls 2-4 (a fresh machine; benchmarks/results moved out of the tree for the carry limit). 2: carry vllm-c +
# unpack.sh, `source .devkit/unpack.sh`; 3: carry vllm-deps + tilelang-0.1.9 + unpack.sh, the same; 4 (this script, carries
# vllm-moe + vllm-py + unpack.sh): main at the end of session 30 (kernels unchanged since session 28). Precompile the bench's kernels, then side by side with
# vLLM's FlashMLA and FA3: the whole grid (Triton left out for time), the quick grid with Triton and --check, the fp8
# rows, and b=1 in CUDA-graph replay
set -o pipefail
source .devkit/unpack.sh
export VLLM_USE_FLASHINFER_SAMPLER=0 TILELANG_CACHE_DIR=/tmp/tlcache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i "warn" | tail -3
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
G=""; for h in 16 32 64 128; do for q in 1 2; do G="$G;1,4096,$h,$q,64"; done; done
G="${G#;};1,4096,16,1,1;1,4096,16,1,16;1,4096,128,1,1;1,4096,128,1,16;1,4096,16,1,64,fp8;1,4096,16,1,16,fp8"
python3 scripts/quick_time.py --shapes "$G" --precompile 10 2>&1 | tail -1
timeout 200 python3 -m mla_backend.bench --grid full --impls ours,flashmla,fa3 --check --out-dir $OUT/full 2>&1 | grep -v Cache | tail -160 > $OUT/bench_full.log
tail -2 $OUT/bench_full.log
timeout 120 python3 -m mla_backend.bench --quick --check --out-dir $OUT/quick 2>&1 | grep -v Cache | tail -60 > $OUT/bench.log
tail -16 $OUT/bench.log
timeout 100 python3 -m mla_backend.bench --quick --fp8 --filter h=16,s_q=1 --out-dir $OUT/fp8 2>&1 | grep -v Cache | tail -30 > $OUT/bench_fp8.log
timeout 60 python3 -m mla_backend.bench --quick --graphs --filter b=1 --out-dir /tmp/bg 2>&1 | grep -v Cache | tail -4 | tee $OUT/bench_graphs.log
tar -C $OUT -czf $OUT/bench_files.tgz full quick fp8 && rm -rf $OUT/full $OUT/quick $OUT/fp8
