#!/bin/bash
# GPU machine: the kernel GPU tests of the working tree, then an A/B of our kernel alone (quick_time.py
# --shapes, graph + eager + per-kernel time) under each setting in AB_SETTINGS, all variants precompiled in
# parallel first. A setting is "name:ENV=VAL,ENV=VAL" (empty env: the tree as is; its ENV wins over the defaults, so
# "seesaw:MLA_BACKEND_SM90_KERNEL=seesaw" times that kernel); a setting "x" runs the package
# in ab_x/ where there is one (e.g. git archive <ref> mla_backend | tar -x -C ab_base), else the working tree.
# Carry .devkit/unpack.sh, .devkit/tilelang-0.1.9.tar.xz, .devkit/vllm-deps.tar.xz (triton for do_bench) and the
# ab_* trees (git-ignored) the settings name.
#   AB_SHAPES="1,4096,16,1,64;128,16384,128,1,64" AB_SETTINGS="base: new:" bash scripts/device_ab.sh
set -o pipefail
source .devkit/unpack.sh
export TILELANG_CACHE_DIR=/tmp/tlcache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee $OUT/gpu.txt
SHAPES=${AB_SHAPES:?AB_SHAPES}
SETTINGS=${AB_SETTINGS:-"new:"}

tree_of() { [ -d "$PWD/ab_${1%%:*}" ] && echo "$PWD/ab_${1%%:*}" || echo "$PWD"; }  # setting "x:" runs ab_x/ if there
env_of() { local e=${1#*:}; echo "${e//,/ }"; }

# 1. correctness first: a hang (barrier protocol) costs the smoke's 180 s (compiles included), not the call
export PYTHONPATH=$PWD:$PYTHONPATH
[ -z "${AB_SKIP_TESTS:-}" ] && SMOKE_TIMEOUT=180 source scripts/device_gpu_tests.sh

# 2. every (setting, shape) variant compiled in parallel into TileLang's disk cache
start=$SECONDS
for setting in $SETTINGS; do
  (env $(env_of "$setting") PYTHONPATH=$(tree_of "$setting"):$PWD/scripts:/tmp/site \
     python3 scripts/quick_time.py --shapes "$SHAPES" --precompile 6 2>&1 | tail -1 | sed "s/^/${setting%%:*} /" \
     | tee -a $OUT/precompile.log) &
done
wait
echo "precompiled in $((SECONDS - start)) s" | tee -a $OUT/precompile.log

# 3. the A/B: one process per setting, all shapes
for setting in $SETTINGS; do
  env PYTHONPATH=$(tree_of "$setting"):$PWD/scripts:/tmp/site MLA_BACKEND_SM90_KERNEL=${MLA_BACKEND_SM90_KERNEL:-tws} $(env_of "$setting") \
    timeout 200 python3 scripts/quick_time.py --shapes "$SHAPES" --kineto 2>&1 | grep -v Cache | grep " b=" \
    | sed "s/^/${setting%%:*} /" | tee -a $OUT/ab.log
done
