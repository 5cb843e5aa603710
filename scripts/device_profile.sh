#!/bin/bash
# GPU machine: compute-sanitizer ($SANITIZERS, default memcheck and racecheck) on small cases + Nsight Compute on the
# h=16 b=128 s_k=16384 decode (bf16 and fp8 caches; NO_NCU=1 skips it). Carry .devkit/tilelang-0.1.9.tar.xz and
# .devkit/unpack.sh.
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 scripts/sanitize_case.py 2>&1 | grep -v Cache | tee $OUT/sanitize_plain.log
for tool in ${SANITIZERS:-memcheck racecheck}; do
  timeout 170 compute-sanitizer --tool $tool --print-limit 20 python3 scripts/sanitize_case.py 2>&1 \
    | grep -v "Cache\|Host Frame\|WARNING" | tail -40 | tee $OUT/sanitize_$tool.log
done
[ -n "${NO_NCU:-}" ] && exit 0
# one launch of each decode kernel (bf16 then fp8; the ws kernel's prim_func is mla_decode_split)
for c in 0; do
  timeout 150 ncu --clock-control none -k regex:mla_decode_split -c 2 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section LaunchStats --section SourceCounters python3 scripts/quick_time.py --fp8 --cases $c --ncu 2>&1 | grep -v Cache \
    | tee $OUT/ncu_case$c.txt | tail -150
done
