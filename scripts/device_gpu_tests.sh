# Sourced by the device drivers (device_ab.sh, device_interleave.sh): the kernel's correctness before any timing.
# The smoke case first (a hang or a mismatch stops the call there: exit 1, SMOKE_TIMEOUT s at most, its two variants'
# compiles included: ~115 s on a fresh machine),
# then tests/test_kernel_gpu.py into $OUT/pytest_gpu.log; with GPU_TESTS_BG=1 the tests run in the background (the
# caller waits for them, e.g. while it precompiles the A/B's variants).
timeout ${SMOKE_TIMEOUT:-240} python3 scripts/quick_time.py --smoke 2>&1 | tail -3 | tee $OUT/smoke.log \
  || { echo "SMOKE FAILED"; exit 1; }
if [ -n "${GPU_TESTS_BG:-}" ]; then
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -40 \
    > $OUT/pytest_gpu.log &
else
  timeout ${PYTEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider tests/test_kernel_gpu.py 2>&1 | tail -25 \
    | tee $OUT/pytest_gpu.log
fi
