source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
for c in "1 4096 16 1 64" "16 4096 128 1 64"; do
  timeout 200 python3 scripts/host_profile.py $c 2>&1 | grep -E "whole call|Error|error" | tee -a $OUT/host.log
done
