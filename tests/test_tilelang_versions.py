"""The kernels the op serves lower (and nvcc compiles them) under the installed TileLang: a small, version-robust
subset of tests/test_lowering*.py, run once per TileLang version that pyproject admits.

``.ci/tilelang_matrix.sh`` runs this file under each version (0.1.9: the main install; the others from side
directories on PYTHONPATH, ``MLA_BACKEND_EXPECT_TILELANG`` naming the version that must be imported, ``-m ''``);
the default ``python3 -m pytest -q`` runs its fast part (one split variant, the combines, the planner) under whatever
TileLang pip resolved. The full lowering matrix (every variant, exact
source text checks, which differ between versions) is marked ``slow`` (tests/conftest.py) and runs under the main
install only.

Variants (the default sm90 config, so the kernel the op builds for each shape):

* 128 heads, q_len 1, page 64, bf16: 2 row blocks, clusters of two sharing each KV block by TMA multicast (the
  construct TileLang 0.1.15's thread-sync pass rejected; a cluster launch is ``T.ClusterKernel`` under 0.1.12,
  ``configs.kernel_launch``); also nvcc-compiled.
* 16 heads, q_len 2, page 64, bf16: 32 rows, one row block, whole KV blocks by TMA per CTA (TileLang >= 0.1.13
  issues a tile's four boxes in a ``#pragma unroll`` loop, 0.1.9 as four statements: same nine boxes per buffer).
* 128 heads, q_len 2, page 1, bf16: 4 row blocks, cp.async gather through the page table.
* 16 heads, q_len 1, page 64, fp8 cache: transposed consumers, register conversion in the producer(s); also
  nvcc-compiled.
* 128 heads, q_len 1, page 64, fp8 cache with ``fp8_compute``: e4m3 WGMMA, q quantised in the kernel, fp8c.cuh's
  inline PTX (``tests/test_lowering_fp8c.py`` checks its source under the main install).
* the combine kernels (per row and wide) and the one-launch planner.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from toolchain import find_nvcc

if os.environ.get("CI"):
    import tilelang  # in CI a broken TileLang install must fail, not skip
else:
    tilelang = pytest.importorskip("tilelang")

from tilelang import tvm  # noqa: E402  (TileLang's bundled TVM)
from tvm.target import Target  # noqa: E402

from mla_backend.kernels import configs  # noqa: E402

CUDA = configs.target_for_arch("sm90")
SM90_SMEM_LIMIT = 232448  # 227 KiB: static + dynamic shared memory one block may use on H100 / H200

# (num_heads, q_len, page_size, dtype, kv_dtype[, fp8_compute]). The default run (``-m 'not slow'``) lowers the first;
# the others and the nvcc compiles (1.5-3.5 min each on 2 busy cores) are marked slow: .ci/tilelang_matrix.sh runs
# them all (``-m ''``) under each version, .ci/run's second pass under the main install.
SPLIT_VARIANTS = [
    (128, 1, 64, "bfloat16", "bfloat16"),
    (16, 2, 64, "bfloat16", "bfloat16"),
    (128, 2, 1, "bfloat16", "bfloat16"),
    (16, 1, 64, "bfloat16", "float8_e4m3"),
    (128, 1, 64, "bfloat16", "float8_e4m3", True),
]
NVCC_VARIANTS = [SPLIT_VARIANTS[0], SPLIT_VARIANTS[3]]


def _vid(v) -> str:
    return "-".join(str(x) for x in v)


def _params(variants, fast: int):
    """``variants`` as pytest params, the first ``fast`` of them unmarked, the rest marked slow."""
    return [pytest.param(v, id=_vid(v), marks=() if i < fast else pytest.mark.slow) for i, v in enumerate(variants)]


def test_expected_tilelang_is_imported():
    """The matrix (.ci/tilelang_matrix.sh) names the version its PYTHONPATH should bring in: a side directory that
    did not install must not silently test the main install's TileLang instead."""
    expected = os.environ.get("MLA_BACKEND_EXPECT_TILELANG")
    if not expected:
        pytest.skip("MLA_BACKEND_EXPECT_TILELANG not set (set by .ci/tilelang_matrix.sh)")
    assert tilelang.__version__.split("+")[0] == expected, (tilelang.__version__, tilelang.__file__)


def _split_kernel(variant):
    """The split prim_func the op builds for ``variant`` under the default sm90 settings (``fp8_compute`` when the
    variant's sixth field says so)."""
    shape, fp8_compute = variant[:5], len(variant) > 5 and variant[5]
    cfg = configs.config_for("sm90", fp8_compute)
    from mla_backend.kernels.sm90 import build_decode_kernel

    return build_decode_kernel(*shape, cfg=cfg)


def _prim_func(kind: str, variant: tuple):
    from mla_backend.kernels import combine, plan_kernel

    pdl = configs.config_for("sm90").pdl
    if kind == "split":
        return _split_kernel(variant)
    if kind == "combine":
        *shape, wide = variant
        return combine.build_combine_kernel(*shape, wide=wide, pdl=pdl)
    return plan_kernel.build_plan_kernel(*variant, pdl=pdl)


@pytest.fixture(scope="module")
def lowered():
    """``get(kind, variant) -> CompiledArtifact`` for sm_90a, lowered once per session (serially: ~20-60 s each on
    2 cores)."""
    cache = {}

    def get(kind, variant):
        key = (kind, variant)
        if key not in cache:
            func = _prim_func(kind, variant)
            with tvm.transform.PassContext(config=configs.compat_pass_configs()), tvm.target.Target(CUDA):
                cache[key] = tilelang.lower(func, target=Target(CUDA), enable_device_compile=False)
        return cache[key]

    return get


def _smem_bytes(mod) -> int:
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for _, f in mod.functions.items()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


def tma_boxes(src: str) -> int:
    """TMA loads of the KV cache a source issues, counting a ``tl::tma_load`` in a constant-trip loop as its trip
    count (TileLang >= 0.1.13 keeps a tile's boxes in a ``#pragma unroll`` loop, 0.1.9 writes them out)."""
    lines = src.splitlines()
    total = 0
    for i, line in enumerate(lines):
        if "tl::tma_load(kv_cache_desc" not in line:
            continue
        trips = 1
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = re.match(r"\s*for \(int \w+ = 0; \w+ < (\d+); \+\+\w+\) \{$", lines[j]) if j >= 0 else None
        if m:
            trips = int(m.group(1))
        total += trips
    return total


@pytest.mark.parametrize("variant", _params(SPLIT_VARIANTS, fast=1))
def test_split_kernel_lowers(lowered, variant):
    art = lowered("split", variant)
    src = art.kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_decode_split', src), "no split kernel entry in the source"
    assert "wgmma" in src, "the GEMMs did not lower to Hopper WGMMA"
    assert "warpgroup_reg_alloc<" in src, "no setmaxnreg: the warpgroup roles are gone"
    smem = _smem_bytes(art.device_mod)
    assert 0 < smem <= SM90_SMEM_LIMIT, f"needs {smem} B of dynamic shared memory"
    heads, q_len, page, dtype, kv_dtype, *fp8_compute = variant
    if fp8_compute:  # S by TileLang's e4m3 WGMMA, P V by fp8c.cuh's
        assert src.count("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3") >= 1, "no e4m3 P V WGMMA"
        return
    whole_blocks = page % 64 == 0 and kv_dtype == dtype
    if whole_blocks and heads * q_len > 64:  # two row blocks: the pair shares each block by TMA multicast
        assert src.count("MLA_TMA_MC(k_ready") == 6 and "cluster_sync" in src
    elif whole_blocks:  # one CTA per part: each of the 2 buffers' 3 tiles by TMA (4 + 4 + 1 boxes)
        assert tma_boxes(src) == 18 and "MLA_TMA_MC(k_ready" not in src, tma_boxes(src)
    else:  # cp.async gather (page size 1) or the fp8 producer's loads
        assert "tma_load(kv_cache_desc" not in src and "MLA_TMA_MC(k_ready" not in src


@pytest.mark.parametrize("variant", [(128, 2, "bfloat16", False), (16, 1, "float16", True)], ids=_vid)
def test_combine_kernel_lowers(lowered, variant):
    src = lowered("combine", variant).kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_decode_combine', src)


def test_plan_kernel_lowers(lowered):
    src = lowered("plan", (1000, 64)).kernel_source
    assert re.search(r'extern "C" __global__ void\b.*mla_plan', src)


@pytest.mark.parametrize("variant", _params(NVCC_VARIANTS, fast=0))
def test_nvcc_compiles_split_for_sm90a(lowered, variant, tmp_path):
    """nvcc + ptxas (-c) with the flags of TileLang's own nvcc callback and its templates: register or
    instruction errors of this TileLang's CUDA show here."""
    nvcc = find_nvcc()
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    src = tmp_path / "split.cu"
    src.write_text(lowered("split", variant).kernel_source)
    cmd = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--use_fast_math", "-w",
           f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "-c", str(src), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-6000:]}"
