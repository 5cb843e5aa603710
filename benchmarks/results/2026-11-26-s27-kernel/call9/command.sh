# session 27, call 9 (carries tilelang-0.1.9 + unpack.sh): the op's settings read through configs.env_get and
# config_for cached by their raw values. Host time per stage and by cProfile (scripts/host_profile.py), then the
# bench's eager and graph b=1 rows for ours (host_us column; session 26's call 10 had 92.8 us at b=1), then the GPU
# tests that switch settings by environment (every combine forced, combine paths, graph replay, page sizes).
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 scripts/host_profile.py 1 4096 16 1 64 2>&1 | grep -v "Warn\|Composable\|TileLang" | tee $OUT/host_b1.log
timeout 100 python3 scripts/host_profile.py 16 4096 128 1 64 2>&1 | grep -v "Warn\|Composable\|TileLang" | head -12 | tee $OUT/host_b16.log
for m in "" "--graphs"; do
  timeout 120 python3 -m mla_backend.cli bench --grid latency --impls ours $m --out-dir $OUT/bench${m#--} 2>&1 | grep -v "Warn\|Composable\|TileLang" | tail -8
done
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py -k "every_combine or combine_paths or graph_replay or page_sizes or tiled_and_row" 2>&1 | tail -4 | tee $OUT/pytest.log
