# session 24, call 7 (carries vllm-c + unpack.sh): source .devkit/unpack.sh
# session 24, call 8 (carries vllm-deps + tilelang-0.1.9 + unpack.sh, same machine):
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH; P="1,4096,16,1,64;128,16384,16,1,16;128,16384,128,1,64;64,8192,128,2,64;128,16384,16,2,64;128,16384,16,1,64,fp8"; python3 scripts/quick_time.py --shapes "$P" --precompile 6 2>&1 | tail -1 & MLA_BACKEND_SM90_NAMEDP=0 python3 scripts/quick_time.py --shapes "128,16384,128,1,64;64,8192,128,2,64" --precompile 2 2>&1 | tail -1 & wait
