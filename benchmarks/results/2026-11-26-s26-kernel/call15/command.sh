# session 26, call 15 (carries tilelang-0.1.9 + unpack.sh; the machine of calls 13-14): compile the tiny model's kernel
# variant (h=16, s_q=1, page 64, bf16) into TileLang's disk cache for call 16's engines
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 scripts/quick_time.py --shapes "1,4096,16,1,64" --precompile 1 2>&1 | tail -1
