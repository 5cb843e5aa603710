#!/bin/bash
# GPU machine, after the vLLM unpack calls (scripts/device_vllm.sh): sustained clock / power / cycles per call of
# ours, FA3 and FlashMLA (scripts/anchor_probe.py), then Nsight Compute on one call of ours and of FA3 at base clock.
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH PYTHONUNBUFFERED=1
SHAPES=${SHAPES:-"128,16384,128,1,64;64,8192,128,2,64;128,16384,16,1,64"}
timeout 240 python3 scripts/anchor_probe.py --shapes "$SHAPES" --impls ours,fa3,flashmla 2>&1 | grep -v Cache \
  | tee $OUT/probe.log
[ -n "${NO_NCU:-}" ] && exit 0
for impl in ours fa3; do
  timeout 120 ncu --profile-from-start off --clock-control base --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section InstructionStats --section SchedulerStats \
    python3 scripts/anchor_probe.py --shapes "${NCU_SHAPE:-128,16384,128,1,64}" --impls $impl --ncu 2>&1 \
    | grep -v Cache > $OUT/ncu_$impl.txt
  tail -5 $OUT/ncu_$impl.txt
done
