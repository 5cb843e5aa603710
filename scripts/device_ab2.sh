#!/bin/bash
# GPU machine: smoke check, then an interleaved A/B (scripts/ab_interleave.py, one process) of the settings
# given as arguments ("name:ENV=VAL,..."), every variant precompiled in parallel first.
# Carry .devkit/unpack.sh, .devkit/tilelang-0.1.9.tar.xz and .devkit/vllm-deps.tar.xz (triton).
#   AB_SHAPES="128,16384,128,1,64;..." AB_ROUNDS=3 bash scripts/device_ab2.sh new: base:MLA_BACKEND_SM90_PAGES=0
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH PYTHONUNBUFFERED=1
SHAPES=${AB_SHAPES:?AB_SHAPES}
start=$SECONDS
for setting in "$@"; do
  e=${setting#*:}
  (env ${e//,/ } python3 scripts/quick_time.py --shapes "$SHAPES" --precompile 8 2>&1 | tail -1 | sed "s/^/${setting%%:*} /") &
done
wait
echo "precompiled in $((SECONDS - start)) s"
[ -z "${AB_SKIP_SMOKE:-}" ] && { timeout 120 python3 scripts/quick_time.py --smoke 2>&1 | tail -2 || exit 1; }
timeout ${AB_TIMEOUT:-400} python3 scripts/ab_interleave.py "$SHAPES" "$@" 2>&1 | grep -v Cache | tee $OUT/ab.log
