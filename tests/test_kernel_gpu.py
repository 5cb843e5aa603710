"""TileLang kernel vs the fp32 reference on the GPU (marked gpu: skipped without one).

A test's kernels are 16 heads, q_len 1, page 64, bf16 and a cache of the q dtype, changed by its ``mla_kernels``
marker and its heads / q_len / page_size / dtype / kv_dtype parameters (tests/precompile.py): tests/conftest.py compiles
them all in parallel before the run. A test that launches another variant says so in its marker.
"""

from __future__ import annotations

import pytest
import torch

from mla_backend import MLADecodeMetadata, SplitPlanner, mla_decode, mla_decode_reference
from mla_backend.dispatch import select_impl
from mla_problems import fill_plan

pytestmark = [pytest.mark.gpu, pytest.mark.mla_kernels]

SCALE = 192**-0.5


def _kernel_or_skip(dtype=torch.bfloat16, kv_dtype=None, heads=16, q_len=1, page_size=64):
    choice = select_impl(torch.device("cuda"), dtype, kv_dtype or dtype, heads, q_len, page_size)
    if choice.impl == "reference":
        pytest.skip(f"no kernel here: {choice.reason}")
    return choice.impl


def make_problem(lens, heads, q_len, page_size, dtype, kv_dtype=None, seed=0, csr=False, device="cuda"):
    """Random q and a paged cache with pages in random order; returns (q, kv_cache, metadata, k_scale)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    batch = len(lens)
    pages_per_req = [-(-n // page_size) for n in lens]
    max_pages = max(max(pages_per_req), 1)
    num_pages = sum(pages_per_req) + 3
    perm = torch.randperm(num_pages, generator=g).int()
    kv = torch.randn(num_pages, page_size, 576, generator=g)
    k_scale = 1.0
    if kv_dtype == torch.float8_e4m3fn:
        k_scale = 0.37
        kv_cache = (kv / k_scale).to(kv_dtype)
    else:
        kv_cache = kv.to(dtype)
    q = torch.randn(batch * q_len, heads, 576, generator=g).to(dtype)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    if csr:
        indptr = torch.zeros(batch + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(pages_per_req), 0)
        md = MLADecodeMetadata.from_csr(indptr, perm[: int(indptr[-1])].contiguous(), page_size, kv_lens=kv_lens,
                                        q_len=q_len)
    else:
        table = torch.full((batch, max_pages + 2), -1, dtype=torch.int32)  # padded, -1 past each request
        used = 0
        for r, n in enumerate(pages_per_req):
            table[r, :n] = perm[used: used + n]
            used += n
        md = MLADecodeMetadata.from_block_table(table, kv_lens, page_size, q_len=q_len)
    return q.to(device), kv_cache.to(device), md.to(device), k_scale


def check(q, kv_cache, md, k_scale, dtype, rel_tol=1e-2, lse_tol=1e-3, fp8_compute=False):
    out = torch.full((q.shape[0], q.shape[1], 512), float("nan"), dtype=q.dtype, device=q.device)  # poison
    o, lse = mla_decode(q, kv_cache, md, SCALE, k_scale=k_scale if kv_cache.dtype != dtype else None, out=out,
                        return_lse=True, fp8_compute=fp8_compute)
    ref_o, ref_lse = mla_decode_reference(q[..., :512].cpu(), q[..., 512:].cpu(), kv_cache.cpu(), md.to("cpu"),
                                          SCALE, k_scale)
    assert o.data_ptr() == out.data_ptr()
    assert not torch.isnan(o).any(), "unwritten or NaN outputs"
    err = (o.float().cpu() - ref_o.float()).norm() / ref_o.float().norm().clamp_min(1e-6)
    assert err < rel_tol, f"relative error {err:.3e}"
    lse_c = lse.cpu()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse_c)), "LSE -inf pattern differs"
    assert (lse_c[finite] - ref_lse[finite]).abs().max() < lse_tol if finite.any() else True
    return err


def parts_per_request(plan, batch):
    """The number of parts of each non-empty request under ``plan`` (the kernels' ``request_parts``)."""
    counts = plan.req_parts[1: 2 * batch: 2].tolist()
    return [n for n in counts if n]


RAGGED = [0, 1, 63, 65, 200, 1000, 64, 2049]
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("csr", [False, True])
def test_page_sizes(page_size, csr):
    _kernel_or_skip(page_size=page_size)
    check(*make_problem(RAGGED, 16, 1, page_size, torch.bfloat16, csr=csr, seed=page_size)[:4], torch.bfloat16)


@pytest.mark.parametrize("heads", [1, 32, 64, 128])
def test_heads(heads):
    _kernel_or_skip(heads=heads)
    check(*make_problem(RAGGED, heads, 1, 64, torch.bfloat16, seed=heads), torch.bfloat16)


@pytest.mark.parametrize("heads,q_len,page_size", [(16, 2, 64), (128, 2, 64), (16, 3, 16), (32, 4, 1), (128, 4, 16)])
def test_mtp_causal(heads, q_len, page_size):
    _kernel_or_skip(heads=heads, q_len=q_len, page_size=page_size)
    lens = [q_len, q_len + 1, 63, 65, 300, 1500]
    check(*make_problem(lens, heads, q_len, page_size, torch.bfloat16, seed=q_len), torch.bfloat16)


# Two or more 64-row blocks below page 64 (no CTA pairs there: each row-block CTA gathers every block itself); one
# request long enough to be split over many parts
@pytest.mark.parametrize("heads,q_len,page_size,dtype", [(128, 1, 1, BF16), (128, 1, 16, BF16), (128, 1, 32, BF16),
                                                         (64, 2, 16, BF16), (128, 2, 1, FP16)])
def test_row_blocks_below_page_64(heads, q_len, page_size, dtype):
    _kernel_or_skip(heads=heads, q_len=q_len, page_size=page_size)
    lens = [max(n, q_len) for n in RAGGED] + [9000]
    check(*make_problem(lens, heads, q_len, page_size, dtype, seed=page_size + heads)[:4], dtype)


@pytest.mark.mla_kernels(dtype=FP16)
def test_fp16():
    _kernel_or_skip(dtype=torch.float16)
    check(*make_problem(RAGGED, 16, 1, 64, torch.float16, seed=5), torch.float16)


@pytest.mark.parametrize("lens,heads,q_len,kind", [([20000], 16, 1, "wide"), ([9000, 0], 16, 1, "wide"),
                                                    ([5000], 128, 1, "row"), ([0, 1, 63, 65, 3000, 8192] * 7, 16, 1, "row"),
                                                    ([0, 1, 63, 65, 3000, 8192] * 6 + [20000, 5, 100, 7], 128, 2,
                                                     "tiled")])
def test_combine_paths(lens, heads, q_len, kind):
    """Short batches take the wide combine (b=1: over 64 parts, so past its first loads too), large ones the tiled
    combine (16 rows per program: here the long request's many parts and the empty requests), others the per-row
    combine; all against the reference (LSE included)."""
    impl = _kernel_or_skip(heads=heads, q_len=q_len)
    from mla_backend.kernels.runtime import get_kernels, pick_combine

    q, kv_cache, md, k_scale = make_problem(lens, heads, q_len, 64, BF16, seed=21)
    md.plan = SplitPlanner(len(lens), heads, q_len, "cuda").plan(md.kv_lens)
    kernels = get_kernels(heads, q_len, 64, BF16, BF16, impl.split("-", 1)[1])
    by_kind = {"row": kernels.combine, "wide": kernels.combine_wide, "tiled": kernels.combine_tiled}
    assert pick_combine(kernels, len(lens), heads * q_len, md.plan.num_parts) is by_kind[kind]
    check(q, kv_cache, md, k_scale, BF16)


def force_combine(monkeypatch, choice: str) -> None:
    """mla_decode launches the ``choice`` combine ("row", "wide" or "tiled") whatever the shape."""
    from mla_backend.kernels import runtime

    attr = {"row": "combine", "wide": "combine_wide", "tiled": "combine_tiled"}[choice]
    monkeypatch.setattr(runtime, "pick_combine", lambda kernels, *shape: getattr(kernels, attr))


@pytest.mark.parametrize("heads,q_len,page_size", [(1, 1, 64), (16, 3, 16)])
@pytest.mark.parametrize("choice", ["row", "wide", "tiled"])
def test_every_combine(choice, heads, q_len, page_size, monkeypatch):
    """Each combine forced (runtime.pick_combine patched) on one plan with empty requests, requests of one part, of two (which
    the split kernel merges) and of up to ~80 parts; 1 and 48 rows (the tiled combine's 16-row tiles clamped and
    whole). Against the reference."""
    _kernel_or_skip(heads=heads, q_len=q_len, page_size=page_size)
    force_combine(monkeypatch, choice)
    lens = [0, 1, 63, 300, 3000, 8192, 20000, 5, 0, 700]
    q, kv_cache, md, k_scale = make_problem(lens, heads, q_len, page_size, BF16, seed=31 + heads)
    md.plan = SplitPlanner(len(lens), heads, q_len, "cuda").plan(md.kv_lens)
    parts = parts_per_request(md.plan, len(lens))
    assert 1 in parts and 2 in parts and max(parts) > 8, parts
    check(q, kv_cache, md, k_scale, BF16)


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1)])
def test_tiled_and_row_combines_agree_bit_for_bit(heads, q_len, monkeypatch):
    """Up to 8 parts per request the tiled combine sums the same terms in the same order as the per-row one: the same
    bits, so a step's output does not depend on which one its batch size picks (vLLM's full CUDA graphs pad it)."""
    _kernel_or_skip(heads=heads, q_len=q_len)
    lens = [0, 1, 300, 1000, 2000, 700, 64, 3000, 129, 5]
    q, kv_cache, md, k_scale = make_problem(lens, heads, q_len, 64, BF16, seed=41 + heads)
    md.plan = SplitPlanner(len(lens), heads, q_len, "cuda", num_sms=16 * -(-heads * q_len // 64)).plan(md.kv_lens)
    parts = parts_per_request(md.plan, len(lens))
    assert max(parts) <= 8 and sum(p > 2 for p in parts) >= 2, parts
    results = {}
    for choice in ("row", "tiled"):
        force_combine(monkeypatch, choice)
        out = torch.full((q.shape[0], heads, 512), float("nan"), dtype=BF16, device="cuda")
        results[choice] = mla_decode(q, kv_cache, md, SCALE, out=out, return_lse=True)
    assert torch.equal(results["row"][0], results["tiled"][0]) and torch.equal(results["row"][1], results["tiled"][1])
    check(q, kv_cache, md, k_scale, BF16)


@pytest.mark.parametrize("heads,q_len,kv_dtype", [(16, 1, BF16), (16, 1, FP8), (64, 1, BF16), (128, 2, BF16)])
def test_split_requests_merged_by_the_combine(heads, q_len, kv_dtype):
    """A plan (12 parts per row block) that cuts requests into one, two and more parts: each part of a split request
    leaves its partial, the combine merges them. Against the reference, and the same bits on every run."""
    _kernel_or_skip(heads=heads, q_len=q_len, kv_dtype=kv_dtype)
    from mla_backend.kernels.common import num_row_blocks

    lens = [3000, 1, 5000, 64, 700, 2500, 129, 4096, 0, 1300]
    q, kv_cache, md, k_scale = make_problem(lens, heads, q_len, 64, BF16, kv_dtype, seed=heads + q_len)
    row_blocks = num_row_blocks(heads, q_len, 64)
    md.plan = SplitPlanner(len(lens), heads, q_len, "cuda", num_sms=12 * row_blocks).plan(md.kv_lens)
    parts = parts_per_request(md.plan, len(lens))
    assert 1 in parts and 2 in parts and max(parts) > 2, parts
    check(q, kv_cache, md, k_scale, BF16, rel_tol=2e-2 if kv_dtype == FP8 else 1e-2)
    first = mla_decode(q, kv_cache, md, SCALE, k_scale=k_scale if kv_dtype == FP8 else None)
    for _ in range(5):
        again = mla_decode(q, kv_cache, md, SCALE, k_scale=k_scale if kv_dtype == FP8 else None)
        assert torch.equal(first, again), "the merged output changed between runs"


@pytest.mark.parametrize("heads,q_len,kv_dtype,fp8_compute", [(128, 1, BF16, False), (16, 1, BF16, False),
                                                              (128, 2, BF16, False), (128, 1, FP8, True)])
def test_balanced_cut(heads, q_len, kv_dtype, fp8_compute):
    """A ragged batch that the plan kernel cuts with a width per part (the batch of an SGLang DP-attention rank: 64
    requests of 4.1-4.3k tokens, with an empty one and a short one), parts of differing widths, requests of one part
    and of two or more: against the reference, and the plan against its Python model."""
    _kernel_or_skip(heads=heads, q_len=q_len, kv_dtype=kv_dtype)
    import random

    rng = random.Random(heads + q_len)
    lens = [rng.randrange(4096, 4300) for _ in range(62)] + [0, 70]
    q, kv_cache, md, k_scale = make_problem(lens, heads, q_len, 64, BF16, kv_dtype, seed=heads * 3 + q_len)
    planner = SplitPlanner(len(lens), heads, q_len, "cuda")
    md.plan = planner.plan(md.kv_lens)
    assert_plan_is(md.plan, expected_plan(torch_planner(planner, heads, q_len), md.kv_lens.cpu()))
    widths = set((md.plan.part_start[1:] - md.plan.part_start[:-1]).tolist()) - {0}
    parts = parts_per_request(md.plan, len(lens))
    assert len(widths) > 1 and 1 in parts and max(parts) >= 2, (widths, parts)
    if fp8_compute:
        check(q, kv_cache, md, k_scale, BF16, rel_tol=6e-2, lse_tol=0.3, fp8_compute=True)
    else:
        check(q, kv_cache, md, k_scale, BF16, rel_tol=2e-2 if kv_dtype == FP8 else 1e-2)


@pytest.mark.parametrize("kv_dtype,lens,seed,rel_tol", [(None, [32768, 0, 1, 5000], 7, 1e-2),
                                                       (FP8, [32768, 0, 1, 5000, 95], 17, 2e-2)])
def test_long_and_zero(kv_dtype, lens, seed, rel_tol):
    """A 32768-token request (split over many parts), an empty one, a single token; bf16 and fp8 caches."""
    _kernel_or_skip(kv_dtype=kv_dtype)
    check(*make_problem(lens, 16, 1, 64, BF16, kv_dtype=kv_dtype, seed=seed), BF16, rel_tol=rel_tol)


@pytest.mark.parametrize("heads,q_len,page_size,dtype", [(16, 1, 64, BF16), (16, 1, 64, FP16), (16, 1, 1, BF16),
                                                         (128, 2, 16, BF16), (16, 1, 16, BF16), (16, 1, 128, FP16),
                                                         (8, 2, 32, BF16)])
@pytest.mark.mla_kernels(kv_dtype=FP8)
def test_fp8_cache(heads, q_len, page_size, dtype):
    _kernel_or_skip(dtype=dtype, kv_dtype=FP8, heads=heads, q_len=q_len, page_size=page_size)
    lens = RAGGED if q_len == 1 else [q_len, 63, 65, 300, 1500]
    check(*make_problem(lens, heads, q_len, page_size, dtype, kv_dtype=FP8, seed=9), dtype, rel_tol=2e-2)


# fp8 compute (q quantised per (token, head) row, e4m3 WGMMA): the ws kernel's shapes, more than 16 rows. Measured
# against the fp32 reference on the dequantised cache: 2-3.5e-2 of the output's norm, LSE within 0.15.
@pytest.mark.parametrize("heads,q_len,page_size,dtype", [(128, 1, 64, BF16), (128, 2, 64, BF16), (64, 2, 16, BF16),
                                                         (32, 1, 64, BF16), (128, 1, 1, BF16), (16, 2, 64, FP16)])
@pytest.mark.mla_kernels(kv_dtype=FP8, fp8_compute=True)
def test_fp8_compute(heads, q_len, page_size, dtype):
    from mla_backend.launcher import prepare_variant

    _kernel_or_skip(dtype=dtype, kv_dtype=FP8, heads=heads, q_len=q_len, page_size=page_size)
    variant = prepare_variant(torch.device("cuda"), heads, q_len, page_size, dtype, FP8, fp8_compute=True)
    assert variant.fp8_compute, "the e4m3-compute kernel was not selected"
    lens = [max(n, q_len) for n in RAGGED] + [0, 9000]
    check(*make_problem(lens, heads, q_len, page_size, dtype, kv_dtype=FP8, seed=heads + q_len), dtype, rel_tol=6e-2,
          lse_tol=0.3, fp8_compute=True)


# q x 1e-3: a flat softmax, the error of q x 1 (measured within 6e-2); q x 30: a peaked one, where q's e4m3 rounding
# (3 mantissa bits) moves the largest scores by whole units: 0.146 of the output's norm measured on an H200
@pytest.mark.parametrize("q_scale,rel_tol", [(1e-3, 6e-2), (30.0, 0.25)])
@pytest.mark.mla_kernels(heads=128, kv_dtype=FP8, fp8_compute=True)
def test_fp8_compute_q_magnitudes(q_scale, rel_tol):
    """q's scale is per row: a tiny q keeps its relative error; a large q (a peaked softmax) stays bounded."""
    _kernel_or_skip(kv_dtype=FP8, heads=128)
    q, kv, md, k_scale = make_problem(RAGGED, 128, 1, 64, BF16, kv_dtype=FP8, seed=14)
    check((q.float() * q_scale).to(BF16), kv, md, k_scale, BF16, rel_tol=rel_tol, lse_tol=0.3 * max(q_scale, 1.0),
          fp8_compute=True)


def _flashmla_fp8():
    """FlashMLA's dense fp8 decode as an engine ships it: (metadata fn, forward fn), or skip."""
    try:
        from vllm.v1.attention.ops import flashmla

        if flashmla._is_flashmla_available()[0]:
            return (lambda lens, rows: flashmla.get_mla_metadata_dense_fp8(lens, rows, 1)), \
                flashmla.flash_mla_with_kvcache_fp8
    except ImportError:
        pass
    try:
        from sgl_kernel import flash_mla

        return (lambda lens, rows: flash_mla.get_mla_metadata(lens, rows, 1, is_fp8_kvcache=True)), \
            flash_mla.flash_mla_with_kvcache
    except ImportError:
        pytest.skip("neither vLLM's nor sgl_kernel's FlashMLA is installed")


# Both quantise q to e4m3 and run both products on e4m3 tensor cores; on the same inputs the error against the fp32
# reference differs by under 5% between them at every q magnitude measured (H200), from a flat softmax to a peaked one
@pytest.mark.parametrize("q_scale", [0.3, 1.0, 3.0, 10.0, 30.0])
@pytest.mark.mla_kernels(heads=128, kv_dtype=FP8, fp8_compute=True)
def test_fp8_compute_error_matches_flashmla_fp8(q_scale):
    _kernel_or_skip(kv_dtype=FP8, heads=128)
    metadata_fn, flashmla_fn = _flashmla_fp8()
    g = torch.Generator(device="cpu").manual_seed(int(q_scale * 10))
    lens = [int(n) for n in torch.randint(200, 4100, (32,), generator=g)]
    pages = [-(-n // 64) for n in lens]
    perm = torch.randperm(sum(pages), generator=g).int()
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for r, n in enumerate(pages):
        table[r, :n] = perm[sum(pages[:r]): sum(pages[:r]) + n]
    kv = torch.randn(sum(pages), 64, 576, generator=g).to(FP8).cuda()
    q = (torch.randn(len(lens), 128, 576, generator=g) * q_scale).to(BF16).cuda()
    table, seq_lens = table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    md = MLADecodeMetadata.from_block_table(table, seq_lens, 64, q_len=1)
    ref, _ = mla_decode_reference(q[..., :512].float(), q[..., 512:].float(), kv, md, SCALE, 1.0)
    ours = mla_decode(q, kv, md, SCALE, k_scale=1.0, fp8_compute=True)
    q_descale = q.float().abs().max() / 448.0  # per tensor, as the engines' FlashMLA fp8 paths take it
    tile_metadata, num_splits = metadata_fn(seq_lens, 128)
    theirs = flashmla_fn(q=(q.float() / q_descale).to(FP8).view(len(lens), 1, 128, 576), k_cache=kv.unsqueeze(-2),
                         block_table=table, cache_seqlens=seq_lens, head_dim_v=512,
                         tile_scheduler_metadata=tile_metadata, num_splits=num_splits, softmax_scale=SCALE,
                         causal=True, descale_q=q_descale.reshape(1), descale_k=torch.ones(1, device="cuda"))[0]
    err = [(o.float().view_as(ref) - ref).norm() / ref.norm() for o in (ours, theirs)]
    assert err[0] <= 1.15 * err[1], f"fp8 compute {err[0]:.3e} against FlashMLA fp8 {err[1]:.3e}"


@pytest.mark.parametrize("q_scale", [1e-3, 30.0])
@pytest.mark.mla_kernels(kv_dtype=FP8)
def test_fp8_cache_q_magnitudes(q_scale):
    """With an fp8 cache the Hopper kernel computes in fp16 and holds a bf16 q as fp16 x 2^-8: small and
    large q (peaked softmax) stay within tolerance of the fp32 reference."""
    _kernel_or_skip(kv_dtype=FP8)
    q, kv, md, k_scale = make_problem(RAGGED, 16, 1, 64, BF16, kv_dtype=FP8, seed=13)
    check((q.float() * q_scale).to(BF16), kv, md, k_scale, BF16, rel_tol=2e-2)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.mla_kernels(kv_dtype=FP8)
def test_fp8_dequant_is_exact(dtype):
    """Every e4m3 value (subnormals, +-0, 448) comes out exactly: with one visible position the output
    is k_scale * V of that row, and a power-of-two k_scale keeps it representable in bf16 / fp16."""
    _kernel_or_skip(dtype=dtype, kv_dtype=FP8)
    codes = torch.arange(512) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    g = torch.Generator(device="cpu").manual_seed(3)
    kv = (torch.randn(2, 64, 576, generator=g) * 4).to(FP8)
    kv[1, 0, :512] = codes.to(torch.uint8).view(FP8)  # page 1, slot 0: every code, twice
    q = torch.randn(1, 16, 576, generator=g).to(dtype).cuda()
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    md = MLADecodeMetadata.from_block_table(table, torch.tensor([1], dtype=torch.int32), 64, q_len=1).to("cuda")
    out = torch.full((1, 16, 512), float("nan"), dtype=dtype, device="cuda")
    mla_decode(q, kv.cuda(), md, SCALE, k_scale=0.5, out=out)
    expected = (kv[1, 0, :512].float() * 0.5).to(dtype).float().expand(16, 512)
    assert torch.equal(out[0].float().cpu(), expected), "e4m3 -> dtype conversion is not exact"
    # the same rows among others (two pages, 100 positions), against the reference
    md = MLADecodeMetadata.from_block_table(table, torch.tensor([100], dtype=torch.int32), 64, q_len=1).to("cuda")
    check(q, kv.cuda(), md, 0.5, dtype, rel_tol=2e-2)


def test_no_recompile_across_batches():
    _kernel_or_skip()
    from mla_backend.kernels import runtime

    check(*make_problem([100, 7], 16, 1, 64, torch.bfloat16, seed=1), torch.bfloat16)
    compiled = runtime.STATS.compiled
    for seed, lens in enumerate([[5] * 37, [4000, 3, 17], list(range(1, 90))]):
        check(*make_problem(lens, 16, 1, 64, torch.bfloat16, seed=seed), torch.bfloat16)
    assert runtime.STATS.compiled == compiled


# h=128: the row-block CTA pairs (clusters); batch x heads x q_len >= 2048: the tiled combine (below 64 rows with column
# chunks)
@pytest.mark.parametrize("heads,q_len,batch,max_pages,page_size", [(16, 1, 8, 40, 64), (128, 1, 8, 40, 64),
                                                                   (128, 2, 8, 40, 64), (128, 1, 24, 12, 64),
                                                                   (16, 1, 160, 6, 64), (128, 1, 8, 160, 16)])
def test_cuda_graph_replay_with_new_lengths(heads, q_len, batch, max_pages, page_size):
    impl = _kernel_or_skip(heads=heads, q_len=q_len, page_size=page_size)
    from mla_backend.kernels.runtime import get_kernels, pick_combine

    num_pages = batch * max_pages + 16
    g = torch.Generator(device="cpu").manual_seed(3)
    kv_cache = torch.randn(num_pages, page_size, 576, generator=g).bfloat16().cuda()
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].int().view(batch, max_pages).cuda()
    kv_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * q_len, heads, 576, generator=g).bfloat16().cuda()
    md = MLADecodeMetadata.from_block_table(table, kv_lens, page_size, q_len=q_len)
    planner = SplitPlanner(batch, heads, q_len, "cuda")
    kernels = get_kernels(heads, q_len, page_size, BF16, BF16, impl.split("-", 1)[1])
    tiled = pick_combine(kernels, batch, heads * q_len, planner.num_parts) is kernels.combine_tiled
    assert tiled == (batch * heads * q_len >= 2048)
    out = torch.empty(batch * q_len, heads, 512, dtype=torch.bfloat16, device="cuda")

    def step(lens):
        kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        md.plan = planner.plan(kv_lens)  # outside the graph, into persistent buffers
        return md

    step([100] * batch)
    mla_decode(q, kv_cache, md, SCALE, out=out, check_indices=False)  # compile + warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(q, kv_cache, md, SCALE, out=out, check_indices=False)
    for seed in range(3):
        lens = torch.randint(0, max_pages * page_size, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
        lens = [max(n, q_len) for n in lens]  # each query token sees itself and the tokens before it
        lens[0] = q_len
        step(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = mla_decode(q, kv_cache, md, SCALE)
        assert torch.equal(out, eager), f"graph replay differs from eager for lens {lens}"
        ref, _ = mla_decode_reference(q[..., :512].cpu(), q[..., 512:].cpu(), kv_cache.cpu(), md.to("cpu"), SCALE)
        err = (out.float().cpu() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2


def test_strided_query_views():
    """vLLM hands over q_nope as a transposed bmm output and q_pe as a slice: read in place, no copy."""
    _kernel_or_skip()
    q, kv_cache, md, _ = make_problem(RAGGED, 16, 1, 64, torch.bfloat16, seed=11)
    q_nope = q[..., :512].transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, 512], strides (512, T*512, 1)
    q_pe = torch.cat([q[..., 512:], torch.randn_like(q[..., :8])], dim=-1)[..., :64]  # row stride 72
    got = mla_decode((q_nope, q_pe), kv_cache, md, SCALE)
    want = mla_decode(torch.cat([q_nope, q_pe], -1).contiguous(), kv_cache, md, SCALE)
    assert torch.equal(got, want)


def torch_planner(fused: SplitPlanner, heads: int, q_len: int) -> SplitPlanner:
    """The torch-ops planner (on the CPU) with ``fused``'s size, SM count and blocks: the plan kernel's reference."""
    return SplitPlanner(fused.max_batch, heads, q_len, "cpu", num_sms=fused.num_sms, block_n=fused.block_n)


PLAN_FIELDS = ("part_start", "part_begin_req", "part_end_req", "cu_blocks", "req_parts")


def expected_plan(torch_ops: SplitPlanner, kv_lens: torch.Tensor):
    """The plan kernel's plan, in Python: the torch planner's one-width cut, replaced by ``balanced_cut`` where that
    is ``BALANCED_MIN_GAIN`` cheaper. Returns the fields of ``PLAN_FIELDS`` as CPU tensors (req_parts and cu_blocks
    cut to the batch)."""
    from mla_backend.planner import hopper_cut

    batch = kv_lens.shape[0]
    plan = torch_ops.plan(kv_lens.cpu())
    blocks = [-(-n // torch_ops.block_n) for n in kv_lens.tolist()]
    starts = hopper_cut(plan, blocks, torch_ops.segment_cost)
    if starts is not None:
        fill_plan(plan, blocks, starts)
    want = {name: getattr(plan, name).clone() for name in PLAN_FIELDS}
    want["cu_blocks"], want["req_parts"] = want["cu_blocks"][: batch + 1], want["req_parts"][: 2 * batch]
    return want


def assert_plan_is(plan, want, what=""):
    batch = want["cu_blocks"].shape[0] - 1
    for name, value in want.items():
        got = getattr(plan, name).cpu()
        got = got[: value.shape[0]] if name in ("cu_blocks", "req_parts") else got
        if name == "req_parts":  # an empty request's first part is not read: compare its count only
            empty = value[1::2] == 0
            got, value = got.clone(), value.clone()
            got[0::2][empty] = value[0::2][empty] = 0
        assert torch.equal(got, value), (what, name, batch)


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 2), (32, 1)])
@pytest.mark.mla_kernels(plans=(300,))
def test_plan_kernel_matches_its_python_model(heads, q_len):
    """The one-launch planner (sm90) writes the plan of its Python model (``expected_plan``): ragged lengths with zeros
    and block edges (where the balanced cut wins), equal lengths (where the cut aligned to the requests wins), batches
    from 1 to the planner's max, an all-empty batch, three part counts (heads x q_len)."""
    _kernel_or_skip(heads=heads, q_len=q_len)
    import random

    fused = SplitPlanner(300, heads, q_len, "cuda")
    torch_ops = torch_planner(fused, heads, q_len)
    assert fused._kernel is not None and torch_ops._kernel is None
    rng = random.Random(heads * 10 + q_len)
    for trial in range(40):
        batch = rng.choice([1, 2, 7, 64, 129, 300])
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randrange(1, 40000)]) for _ in range(batch)]
        if trial == 0:
            lens = [0] * batch
        elif trial % 3 == 0:  # equal lengths: 4096 .. 32768 tokens or a random count
            lens = [rng.choice([4096, 8192, 16384, 32768, rng.randrange(1, 40000)])] * batch
        kv_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        assert_plan_is(fused.plan(kv_lens), expected_plan(torch_ops, kv_lens), (trial, lens))


@pytest.mark.mla_kernels(plans=(512, 1024))
def test_plan_kernels_warm_up_to_the_engine_batch():
    """warm_up_plan_kernels (SGLang's warm-up, for its eager planners) compiles one planner kernel per power of two up
    to the engine's max batch: a planner for 1000 requests built afterwards compiles nothing and plans as the torch
    ops do."""
    _kernel_or_skip()
    from mla_backend.kernels import plan_kernel
    from mla_backend.kernels.configs import config_for
    from mla_backend.planner import warm_up_plan_kernels

    assert warm_up_plan_kernels(torch.device("cuda"), 1000) == 3  # 256, 512, 1024
    compiled = dict(plan_kernel._KERNELS)
    fused = SplitPlanner(1000, 16, 1, "cuda")
    # nothing compiled: the planner launches the 1024-request kernel warmed above (through its tvm-ffi entry where
    # TileLang allows, runtime.launch_entry)
    assert plan_kernel._KERNELS == compiled and (1024, fused.block_n, config_for("sm90").pdl) in compiled
    assert fused._kernel is not None
    torch_ops = torch_planner(fused, 16, 1)
    lens = torch.randint(0, 9000, (1000,), dtype=torch.int32, device="cuda")
    assert_plan_is(fused.plan(lens), expected_plan(torch_ops, lens))


@pytest.mark.mla_kernels(plans=((2, 32),))  # the other block size: 96 - 64
def test_plan_with_other_block_size_is_refused():
    """A plan cut in another kernel's KV blocks would index the wrong blocks: refused, naming both."""
    impl = _kernel_or_skip()
    from mla_backend.kernels.configs import config_for
    from mla_backend.validation import MLAInputError

    q, kv_cache, md, _ = make_problem([100, 7], 16, 1, 64, torch.bfloat16, seed=2)
    other = 96 - config_for(impl.split("-", 1)[1]).block_n  # 32 <-> 64
    md.plan = SplitPlanner(2, 16, 1, "cuda", block_n=other).plan(md.kv_lens)
    with pytest.raises(MLAInputError, match=rf"made with {other}-token blocks"):
        mla_decode(q, kv_cache, md, SCALE)


def _early_trigger_copy(numel: int, dtype: str = "bfloat16"):
    """A TileLang kernel copying ``numel`` values that lets the stream's next kernel launch at once
    (griddepcontrol.launch_dependents first), then sleeps ~40 us before it writes: a predecessor such as a CUTLASS or
    FlashInfer kernel built with programmatic dependent launch, made slow. Eight programs, so that most SMs are free
    for a next kernel that starts early (a split program needs a whole SM's registers)."""
    import tilelang
    import tilelang.language as T
    from tilelang import tvm

    from mla_backend.kernels.configs import target_for_arch

    programs, threads = 8, 256

    @T.prim_func
    def early_trigger_copy(src: T.Tensor([numel], dtype), dst: T.Tensor([numel], dtype)):
        with T.Kernel(programs, threads=threads) as bx:
            tx = T.get_thread_binding()
            T.evaluate(T.pdl_trigger())
            for _ in T.serial(40):
                T.evaluate(T.call_extern("handle", "__nanosleep", 1000))
            for k in T.serial(T.ceildiv(numel, programs * threads)):
                if (k * programs + bx) * threads + tx < numel:
                    # (dtype named in the body: TileLang resolves the annotations from the body's closure)
                    dst[(k * programs + bx) * threads + tx] = T.cast(src[(k * programs + bx) * threads + tx], dtype)

    return tilelang.compile(early_trigger_copy, target=tvm.target.Target(target_for_arch("sm90")))


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (128, 2)])
def test_waits_for_a_predecessor_that_triggers_early(heads, q_len):
    """TileLang launches every cluster kernel (h >= 32 here), and every kernel that waits, with programmatic stream
    serialisation allowed: such a kernel may start as soon as the kernel before it triggers its dependents. The split
    and combine kernels wait for it (griddepcontrol.wait) before they read q, the cache or the metadata, so a
    predecessor that triggers early and writes q late still gets its q used."""
    impl = _kernel_or_skip(heads=heads, q_len=q_len)
    if not impl.endswith("sm90"):
        pytest.skip(f"{impl}: no programmatic dependent launch")
    q_new, kv_cache, md, _ = make_problem([3000, 77, 1, 4100, 9000], heads, q_len, 64, BF16, seed=11)
    stale = torch.randn(q_new.shape, generator=torch.Generator().manual_seed(5)).to(BF16)
    q = stale.cuda()
    md.plan = SplitPlanner(md.batch_size, heads, q_len, "cuda").plan(md.kv_lens)
    out = torch.empty(q.shape[0], heads, 512, dtype=BF16, device="cuda")
    mla_decode(q, kv_cache, md, SCALE, out=out, check_indices=False)  # compiled and warm
    copy = _early_trigger_copy(q.numel())
    ref, _ = mla_decode_reference(q_new[..., :512].cpu(), q_new[..., 512:].cpu(), kv_cache.cpu(), md.to("cpu"), SCALE)
    for _ in range(3):
        q.copy_(stale)
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the writer and both kernels are queued before the writer starts
        copy(q_new.view(-1), q.view(-1))  # the split kernel is launched right after it, nothing in between
        mla_decode(q, kv_cache, md, SCALE, out=out, check_indices=False)
        torch.cuda.synchronize()
        assert torch.equal(q, q_new)
        err = (out.float().cpu() - ref.float()).norm() / ref.float().norm()
        assert err < 1e-2, f"relative error {err:.3e}: the kernels read q before its writer finished"


@pytest.mark.parametrize("backend", ["tvm_ffi", "cython"])
@pytest.mark.mla_kernels(plans=(300,))
def test_plan_kernel_waits_for_a_predecessor_that_triggers_early(backend, monkeypatch):
    """The one-launch planner waits for the stream's previous kernel before it reads ``kv_lens``, like the decode
    kernels. TileLang's default launcher (tvm_ffi) allows an early start only for kernels that wait; its cython
    launcher (``TILELANG_EXECUTION_BACKEND=cython``) allows it for every kernel, so there a planner that did not wait
    would plan from the lengths of the step before."""
    _kernel_or_skip()
    from mla_backend.kernels import plan_kernel

    monkeypatch.setattr(plan_kernel, "_KERNELS", {})  # compiled (or loaded) under this launcher
    monkeypatch.setenv("TILELANG_EXECUTION_BACKEND", backend)
    try:
        fused = SplitPlanner(300, 16, 1, "cuda")
    except Exception as err:  # e.g. no Cython on this machine
        if backend == "tvm_ffi":
            raise
        pytest.skip(f"TileLang's {backend} launcher is not usable here: {type(err).__name__}: {err}")
    torch_ops = torch_planner(fused, 16, 1)
    g = torch.Generator().manual_seed(3)
    new_lens = torch.randint(1, 40000, (300,), generator=g, dtype=torch.int32).cuda()
    stale = torch.randint(1, 40000, (300,), generator=g, dtype=torch.int32).cuda()
    kv_lens = stale.clone()
    want = expected_plan(torch_ops, new_lens.cpu())
    copy = _early_trigger_copy(kv_lens.numel(), "int32")
    for _ in range(3):
        kv_lens.copy_(stale)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the writer and the planner are queued before the writer starts
        copy(new_lens, kv_lens)
        got = fused.plan(kv_lens)
        torch.cuda.synchronize()
        assert torch.equal(kv_lens, new_lens)
        assert_plan_is(got, want, "the planner read kv_lens before its writer finished")
