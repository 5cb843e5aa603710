# session 27, calls 11-13 (one machine, the one of call 10; carry tilelang-0.1.9 + unpack.sh)
# call 11: ../call10/command_b.sh with the first stand-in of the earlier settings path (it read every setting twice
#          per config_for: overstates the earlier cost; superseded)
# call 12: ../call10/command_b.sh with earlier_config_for as the code was (host_profile.py at this commit)
bash benchmarks/results/2026-11-26-s27-kernel/call10/command_b.sh
# call 13: the whole GPU test file on the final host path
source .devkit/unpack.sh; export TILELANG_CACHE_DIR=/tmp/tlcache PYTHONPATH=$PWD:$PWD/scripts:$PYTHONPATH
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py
