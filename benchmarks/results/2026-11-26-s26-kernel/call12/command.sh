# session 26, call 12 (carries tilelang-0.1.9 + unpack.sh; a fresh machine): evidence for the h=128 page-size gap.
# Our kernel alone at b=128 s_k=16384 h=128 with pages of 64, 16 and 1 (quick_time: graph replay and eager after an
# L2 flush), the three shapes in turn, 3 rounds; then Nsight Compute on the split kernel at page 64 and page 16
# (speed of light, memory workload, warp states, scheduler)
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee $OUT/gpu.txt
S="128,16384,128,1,64;128,16384,128,1,16;128,16384,128,1,1"
python3 scripts/quick_time.py --shapes "$S" --precompile 3 2>&1 | tail -1
for r in 1 2 3; do timeout 60 python3 scripts/quick_time.py --shapes "$S" 2>&1 | grep "b=" | sed "s/^/round $r /" | tee -a $OUT/pages.log; done
for p in 64 16; do
  timeout 150 ncu --clock-control none -k regex:mla_decode_split -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
    python3 scripts/quick_time.py --shapes "128,16384,128,1,$p" --ncu 2>&1 | grep -v Cache | tail -120 > $OUT/ncu_p$p.txt
  grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Memory Throughput|Compute \(SM\)|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Issued Ipc|Cluster" $OUT/ncu_p$p.txt | sed "s/^/p$p /"
done
