source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="1,4096,16,1,64;1,4096,128,1,64;1,4096,16,1,1"
python3 scripts/quick_time.py --shapes "$S" --precompile 3 2>&1 | tail -1
timeout 200 python3 scripts/timeline.py "1,4096,16,1,64" --min-blocks 1,2,4 2>&1 | grep -v Warn | tee $OUT/timeline.log
timeout 120 python3 scripts/timeline.py "1,64,16,1,64;1,1024,16,1,64;1,4096,128,1,64;1,4096,16,1,1" 2>&1 | grep -v Warn | tee -a $OUT/timeline.log
timeout 120 ncu --section SpeedOfLight --section LaunchStats --section WarpStateStats -k regex:mla_decode -c 2 python3 scripts/quick_time.py --shapes "1,4096,16,1,64" --ncu > $OUT/ncu.txt 2>&1
grep -E "mla_decode|Duration|Elapsed Cycles|DRAM Through|Stall|Grid Size|Registers|Shared Memory Config|Dynamic Shared" $OUT/ncu.txt | head -40
