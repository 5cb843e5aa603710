# session 27, calls 4-7 (one machine, the one of call 3; benchmarks/results moved out of the tree for calls 4-5 so the
# bundles fit the 64 MiB carry; bundles built with ../shared/devkit/sglang.sh, plus sgl-extra and sgl-deepgemm as
# scripts/device_sglang.sh says)
# call 4: carry .devkit/sglang, sgl-kernel, sglang-deps + unpack.sh
source .devkit/unpack.sh && python3 -c "import sglang, sgl_kernel; print('sglang', sglang.__version__)"
# call 5: carry .devkit/flashinfer-sgl, tilelang-0.1.11, sgl-ipython, sgl-transformers, sgl-extra, sgl-deepgemm +
# unpack.sh (TileLang 0.1.9 of call 3 removed from /tmp/site first)
rm -rf /tmp/site/tilelang /tmp/site/tilelang-0.1.9.dist-info /tmp/site/apache_tvm_ffi-0.1.10.dist-info /tmp/site/tvm_ffi /tmp/site/.unpacked-tilelang-0.1.9
bash scripts/device_sglang.sh e2e --forced --budget 540        # -> call5_sglang_forced_cold.json
# calls 6 and 7: carry unpack.sh only (same machine, caches warm)
bash scripts/device_sglang.sh e2e --forced --budget 340 --engine-timeout 250 --only tilelang_p64_forced --only flashmla_p64_forced  # -> call6
bash scripts/device_sglang.sh e2e --forced --budget 270 --engine-timeout 200 --only tilelang_p1_forced --only triton_p1_forced     # -> call7
