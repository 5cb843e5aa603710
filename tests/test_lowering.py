"""The TileLang kernels lower for Hopper (and MI300X) on a machine without a GPU, and nvcc compiles them.

Lowering runs TileLang's whole pipeline (layout inference, pipelining, WGMMA selection, codegen to CUDA
C++), so a kernel that TileLang rejects, or whose CUDA source does not compile, fails here in CI rather
than on the first GPU. What is left to the GPU tests is numerics and launch-time limits.
Each lowering takes ~10-20 s on 2 cores, so every variant is lowered once per test session.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from toolchain import find_nvcc, kernel_body

if os.environ.get("CI"):
    import tilelang  # in CI a broken TileLang install must fail, not skip
else:
    tilelang = pytest.importorskip("tilelang")

from tilelang import tvm  # noqa: E402  (TileLang's bundled TVM)
from tvm.target import Target  # noqa: E402

from mla_backend.constants import MAX_PARTS  # noqa: E402
from mla_backend.kernels import configs  # noqa: E402
from mla_backend.kernels import sm90  # noqa: E402
from mla_backend.kernels.combine import (build_combine_kernel, build_tiled_combine_kernel,  # noqa: E402
                                         tiled_combine_chunks)
from mla_backend.kernels.portable import build_decode_kernel  # noqa: E402
from mla_backend.kernels.plan_kernel import build_plan_kernel, scan_size  # noqa: E402

CUDA = configs.target_for_arch("sm90")  # "cuda -arch=sm_90a"
HIP = configs.target_for_arch("gfx942")  # "hip -mcpu=gfx942"
SM90_SMEM_LIMIT = 227 * 1024  # bytes of shared memory one block may opt into on H100/H200
GFX942_LDS_LIMIT = 64 * 1024  # bytes of LDS per workgroup on MI300X

# (num_heads, q_len, page_size, dtype, kv_dtype): DeepSeek-V3 at TP1 (128 heads) and TP8 (16 heads),
# MTP (q_len 2), the page sizes engines use (SGLang 1, FlashInfer-style 16, FlashMLA 64), fp8 cache.
SPLIT_VARIANTS = [
    (128, 1, 64, "bfloat16", "bfloat16"),
    (16, 1, 64, "bfloat16", "bfloat16"),
    (16, 2, 16, "float16", "float16"),
    (128, 2, 1, "bfloat16", "bfloat16"),
    (16, 1, 64, "bfloat16", "float8_e4m3"),
]
# (num_heads, q_len, dtype, wide): the per-row combine and the wide one (short batches, per 128 dims)
COMBINE_VARIANTS = [(16, 1, "bfloat16", False), (128, 2, "bfloat16", False), (16, 2, "float16", False),
                    (16, 1, "bfloat16", True), (128, 2, "float16", True)]
# (num_heads, q_len, dtype) of the tiled combine (16 rows per program): whole tiles, and 1 and 24 rows (clamped)
TILED_VARIANTS = [(16, 1, "bfloat16"), (128, 2, "bfloat16"), (1, 1, "float16"), (8, 3, "bfloat16")]
# (max_batch, block_n) of the one-launch planner: the smallest scan buffer, and 1024 entries (4 per thread)
PLAN_VARIANTS = [(8, 64), (1000, 64)]


def _vid(v) -> str:
    return "-".join(str(x) for x in v)


def _prim_func(kind: str, variant: tuple, cfg: configs.KernelConfig):
    if kind == "split":  # the Hopper product (kernels/sm90/; tests/test_lowering_ws*.py check its schedule)
        return sm90.build_decode_kernel(*variant, cfg)
    if kind == "plan":
        return build_plan_kernel(*variant, pdl=cfg.pdl)
    if kind == "tiled":
        return build_tiled_combine_kernel(*variant, chunks=tiled_combine_chunks(variant[0] * variant[1]), pdl=cfg.pdl)
    *shape, wide = variant
    return build_combine_kernel(*shape, wide=wide, pdl=cfg.pdl)  # the combines serve every config


def _waits_before(src: str, first_read: str) -> bool:
    """pdl: the kernel waits for the stream's previous kernel (griddepcontrol.wait) before its first read of
    ``first_read`` (docs/kernels.md)."""
    body = kernel_body(src)
    return body.index("cudaGridDependencySynchronize();") < body.index(first_read)


def _smem_bytes(mod) -> int:
    """Dynamic shared memory of the device kernel(s) in a lowered IRModule (0 when none)."""
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for _, f in mod.functions.items()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


@pytest.fixture(scope="module")
def cuda_lowered():
    """``get(kind, variant) -> CompiledArtifact`` for sm_90a, lowered once per test session."""
    cache = {}

    def get(kind, variant):
        key = (kind, variant)
        if key not in cache:
            func = _prim_func(kind, variant, configs.SM90)
            with tvm.transform.PassContext(config=configs.compat_pass_configs()), tvm.target.Target(CUDA):
                cache[key] = tilelang.lower(func, target=Target(CUDA), enable_device_compile=False)
        return cache[key]

    return get


# ----------------------------------------------------------------------------- Hopper
@pytest.mark.parametrize("variant", SPLIT_VARIANTS, ids=_vid)
def test_split_kernel_lowers_to_wgmma(cuda_lowered, variant):
    art = cuda_lowered("split", variant)
    src = art.kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_decode_split', src), "no split kernel entry in the source"
    assert "wgmma" in src, "the split kernel's GEMMs did not lower to Hopper WGMMA"
    assert _waits_before(src, "part_start[")
    smem = _smem_bytes(art.device_mod)
    assert 0 < smem <= SM90_SMEM_LIMIT, f"needs {smem} B of shared memory; a block may use {SM90_SMEM_LIMIT} B"


@pytest.mark.parametrize("variant", COMBINE_VARIANTS, ids=_vid)
def test_combine_kernel_lowers(cuda_lowered, variant):
    src = cuda_lowered("combine", variant).kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_decode_combine', src)
    assert _waits_before(src, "req_parts[")
    if variant[-1]:  # wide: the partial rows are read as float4, all COMBINE_WIDE_LOADS of them before the weights
        head = src[:src.index("lse_partial[")]
        assert head.count("*(float4*)(out_partial") == 1 and "for (int u = 0; u < 16; ++u)" in head, head[-3000:]


@pytest.mark.parametrize("variant", TILED_VARIANTS, ids=_vid)
def test_tiled_combine_lowers(cuda_lowered, variant):
    """16 rows per program (and below 64 rows a quarter of the columns): each row's 8 lanes take its partial LSEs'
    max by three xor shuffles and write exp2(LSE - max) to shared memory (16 rows x MAX_PARTS), summed in part order
    by every lane (the per-row combine's order); then every thread loads float4s of the 16 partial rows, 4 parts back
    to back, and adds each term by one fma; requests of one part (written by the split kernel) are skipped."""
    art = cuda_lowered("tiled", variant)
    src = art.kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_decode_combine_tiled', src)
    assert _waits_before(src, "qo_indptr[")
    assert src.count("__shfl_xor_sync(") == 1 and "(4 >> delta" in src, "the LSE max is not an 8-lane shuffle"
    assert re.search(r"for \(int j = 0; j < n_read; \+\+j\) \{\s*total = \(total \+ weight_s\[", src), "sum not in part order"
    assert "if (1 < n_read)" in src
    assert src.count("*(float4*)(out_partial") == 1 and "for (int u = 0; u < 4; ++u)" in src
    assert "= __fmaf_rn(" in src, "the partial rows' terms are not added by an explicit fma (the per-row combine's bits)"
    narrow = variant[0] * variant[1] < 64
    assert ("((int)blockIdx.z)) * (int64_t)128)" in src) == narrow  # the chunk's 128 columns
    assert re.search(r"float acc\[(\d+)\]", src).group(1) == ("16" if narrow else "64")
    assert _smem_bytes(art.device_mod) == 16 * 256 * 4


@pytest.mark.parametrize("variant", PLAN_VARIANTS, ids=_vid)
def test_plan_kernel_lowers(cuda_lowered, variant):
    """The planner in one launch: a prefix sum of KV blocks in shared memory (one warp's CumSum1D over the scan
    buffer), the longest request, the non-empty requests and the segments of two cuts folded by warp shuffles (one
    shared slot per warp and sum), the one-width cut's costliest part and the cap search's rounds (a maximum and a
    minimum each), then a binary search per part; batch, part count and segment cost stay runtime arguments. Like the
    decode kernels it first waits for the stream's previous kernel (the writer of ``kv_lens``)."""
    art = cuda_lowered("plan", variant)
    src = art.kernel_source
    assert _waits_before(src, "kv_lens[")
    n = scan_size(variant[0])
    assert re.search(r'extern "C" __global__ void\b.*mla_plan', src)
    assert re.search(rf"tl::CumSum1D<256, false>::run\(\(&\(.*\[0\]\)\), \(&\(.*\[0\]\)\), {n}\);", src)
    assert "int batch" in src and "int num_parts" in src and "int min_blocks" in src and "int segment_cost" in src
    assert src.count("tl::warp_reduce_max(") == 3 and src.count("tl::warp_reduce_sum(") == 3
    assert src.count("tl::warp_reduce_min(") == 1
    # the scan buffer and the cut's part starts, and at most the per-warp statistics (TileLang may merge them); up to
    # 16 bytes of alignment after each of the three buffers (0.1.9 pads the 257 part starts to 1040 bytes)
    smem = 4 * n + 4 * (MAX_PARTS + 1)
    assert smem <= _smem_bytes(art.device_mod) <= smem + 4 * 6 * 8 + 3 * 16


@pytest.mark.parametrize("kind,variant", [("split", SPLIT_VARIANTS[0]), ("split", SPLIT_VARIANTS[4]),
                                          ("combine", COMBINE_VARIANTS[1]), ("combine", COMBINE_VARIANTS[3]),
                                          ("tiled", TILED_VARIANTS[3]),
                                          ("plan", PLAN_VARIANTS[1])], ids=lambda v: _vid(v) if isinstance(v, tuple) else v)
def test_nvcc_compiles_for_sm90a(cuda_lowered, kind, variant, tmp_path):
    """The flags TileLang's own nvcc callback uses (tilelang.engine.lower.tilelang_callback_cuda_compile),
    with -c: ptxas runs too, so register or instruction errors show here."""
    nvcc = find_nvcc()
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    src = tmp_path / f"{kind}.cu"
    src.write_text(cuda_lowered(kind, variant).kernel_source)
    cmd = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--use_fast_math", "-w",
           f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "-c", str(src), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-6000:]}"


# ----------------------------------------------------------------------------- MI300X
def _lower_hip_to_device_ir(func):
    """TileLang's lowering up to device codegen (the MFMA choice is made here), for gfx942."""
    with tvm.target.Target(HIP):
        target = Target(HIP)
        mod = tvm.IRModule({func.attrs["global_symbol"]: func})
        try:  # TileLang <= 0.1.10: two phase functions
            from tilelang.engine.phase import LowerAndLegalize, OptimizeForTarget
        except ImportError:
            pass
        else:
            return OptimizeForTarget(LowerAndLegalize(mod, target), target)
        import tilelang.backend as backend

        if hasattr(backend, "create_backend_context"):  # >= 0.1.15: the pipeline of a resolved backend
            return backend.create_backend_context(target).lower(mod)
        return backend.resolve_pipeline(target).lower(mod, target)  # 0.1.11 - 0.1.12: one per target kind


def _hip_codegen_available() -> bool:
    return tvm.ffi.get_global_func("target.build.tilelang_hip_without_compile", allow_missing=True) is not None


@pytest.mark.parametrize("heads,q_len,page_size,kv_dtype", [
    (16, 1, 64, "bfloat16"), (128, 2, 1, "bfloat16"), (32, 1, 16, "bfloat16"),
    (16, 1, 64, "float8_e4m3fnuz"), (128, 2, 1, "float8_e4m3fnuz"),  # converted into the 16-bit tiles: same LDS
])
def test_split_kernel_lowers_to_mfma_on_gfx942(heads, q_len, page_size, kv_dtype):
    func = build_decode_kernel(heads, q_len, page_size, "bfloat16", kv_dtype, configs.GFX942)
    mod = _lower_hip_to_device_ir(func)
    script = mod.script()
    assert "mfma" in script, "the split kernel's GEMMs did not lower to MFMA"
    lds = _smem_bytes(mod)
    assert lds <= GFX942_LDS_LIMIT, f"needs {lds} B of LDS; MI300X has {GFX942_LDS_LIMIT} B per workgroup"
    if _hip_codegen_available():
        with tvm.target.Target(HIP):
            src = tilelang.lower(func, target=Target(HIP), enable_device_compile=False).kernel_source
        assert "mfma" in src


@pytest.mark.parametrize("wide", [False, True])
def test_combine_kernel_lowers_on_gfx942(wide):
    _lower_hip_to_device_ir(build_combine_kernel(16, 1, "bfloat16", wide=wide))


def test_hip_source_codegen():
    """HIP C++ needs a TileLang built with ROCm; the PyPI wheel is built for CUDA only."""
    if not _hip_codegen_available():
        pytest.skip(f"TileLang {tilelang.__version__} has no HIP codegen in this build "
                    "(target.build.tilelang_hip_without_compile is not registered)")
    with tvm.target.Target(HIP):
        art = tilelang.lower(build_combine_kernel(16, 1, "bfloat16"), target=Target(HIP),
                             enable_device_compile=False)
    assert "__global__" in art.kernel_source
