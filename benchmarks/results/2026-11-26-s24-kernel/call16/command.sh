# session 24, call 16: CUDA-graph capture and replay with new lengths, now also for h=128 s_q=1 / s_q=2 (the row-block
# CTA pairs' cluster launch), against eager and the fp32 reference; then all GPU tests' count again
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 scripts/quick_time.py --shapes "8,2560,16,1,64;8,2560,128,1,64;8,2560,128,2,64" --precompile 3 2>&1 | tail -1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k cuda_graph 2>&1 | tail -5 | tee $OUT/pytest_graph.log
