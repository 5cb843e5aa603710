"""The Hopper kernel (``impl="tilelang-sm90"``) against the fp32 reference on adversarial but valid batches
(marked gpu: skipped without one).

Pages at the very end of the cache (with NaN just past it), every request empty but one, 1-token requests beside
64k ones, a batch at the planner's maximum, stale NaN in the slots and pages no request reads, and NaN inputs,
which must reach the output (FlashMLA and FlashAttention-3 give NaN in that row; so do the reference and the
kernel here, never zeros), and to the LSE, so an LSE merge across ranks cannot drop it. Every output buffer is
poisoned first, so a row the kernel leaves unwritten shows.

Each case runs alone for compute-sanitizer, e.g.::

    compute-sanitizer --tool memcheck python3 -m pytest -q tests/test_kernel_gpu_adversarial.py -k end_of_the_cache
"""

from __future__ import annotations

import pytest
import torch

from mla_backend import MLADecodeMetadata, SplitPlanner, mla_decode, mla_decode_reference
from mla_backend.dispatch import select_impl

pytestmark = [pytest.mark.gpu, pytest.mark.mla_kernels]  # kernels: tests/precompile.py

SCALE = 192**-0.5
BF16 = torch.bfloat16
HEADS = 16
SENTINEL = 1234.0  # poisons out where NaN is the expected answer (NaN elsewhere)


def kernel_or_skip(q_len: int = 1, page_size: int = 64) -> str:
    choice = select_impl(torch.device("cuda"), BF16, BF16, HEADS, q_len, page_size)
    if choice.impl == "reference":
        pytest.skip(f"no kernel here: {choice.reason}")
    return choice.impl


def paged(lens, page_size, q_len=1, seed=0, order="random", spare=2, poison_tail=True):
    """q, a cache that is a view into a NaN-filled buffer (one NaN page before it, NaN pages after it), a block
    table with NaN-page ids past each request's pages, and the pages each request uses.

    order: "random", or "end": the requests' pages are the last pages of the cache, in descending order.
    poison_tail: NaN in the slots past kv_len of each request's last page (never read: the reference does not).
    """
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page_size) for n in lens]
    num_pages = sum(used) + spare
    ids = torch.arange(num_pages - 1, -1, -1) if order == "end" else torch.randperm(num_pages, generator=g)
    buf = torch.full((num_pages + 3, page_size, 576), float("nan"), dtype=BF16)
    kv_cache = buf[1: num_pages + 1]
    kv_cache.copy_(torch.randn(num_pages, page_size, 576, generator=g).to(BF16))
    pages, at = [], 0
    for n in used:
        pages.append(ids[at: at + n].tolist())
        at += n
    nan_page = ids[-1].item() if spare else None  # a page no request uses, filled with NaN
    if nan_page is not None:
        kv_cache[nan_page] = float("nan")
    width = max(used + [0]) + 2
    table = torch.full((len(lens), width), nan_page if nan_page is not None else 0, dtype=torch.int32)
    for r, p in enumerate(pages):
        table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
        if poison_tail and lens[r] % page_size:
            kv_cache[p[-1], lens[r] % page_size:] = float("nan")
    q = torch.randn(len(lens) * q_len, HEADS, 576, generator=g).to(BF16)
    md = MLADecodeMetadata.from_block_table(table, torch.tensor(lens, dtype=torch.int32), page_size, q_len=q_len)
    return q.cuda(), buf.cuda()[1: num_pages + 1], md.to("cuda"), pages


def run_kernel(impl, q, kv_cache, md, poison=float("nan")):
    out = torch.full((q.shape[0], HEADS, 512), poison, dtype=BF16, device="cuda")
    got, lse = mla_decode(q, kv_cache, md, SCALE, out=out, return_lse=True, impl=impl)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    return out, lse


def reference(q, kv_cache, md):
    """The fp32 reference on the GPU (it gathers only each request's pages)."""
    return mla_decode_reference(q[..., :512], q[..., 512:], kv_cache, md, SCALE)


def assert_close_to_reference(out, lse, ref, ref_lse, rel_tol=1e-2):
    assert not torch.isnan(out).any(), "NaN (or an unwritten, NaN-poisoned row) in the kernel's output"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "the LSE -inf pattern differs"
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)
    assert err < rel_tol, f"relative error {err:.3e}"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    blind = torch.isneginf(ref_lse)
    assert torch.equal(out[blind], torch.zeros_like(out[blind])), "a row that sees nothing is not zeros"


@pytest.mark.parametrize("page_size", [1, 64])
def test_pages_at_the_end_of_the_cache(page_size):
    """Page ids N-1, N-2, ... of an N-page cache that ends where NaN pages begin; NaN past each kv_len too."""
    impl = kernel_or_skip(page_size=page_size)
    lens = [1, 3 * page_size + 5, 64, 200, 65]
    q, kv, md, pages = paged(lens, page_size, order="end", spare=0)
    assert pages[0] == [kv.shape[0] - 1]
    assert_close_to_reference(*run_kernel(impl, q, kv, md), *reference(q, kv, md))


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("who", ["first", "middle", "last"])
def test_every_request_empty_but_one(q_len, who):
    impl = kernel_or_skip(q_len=q_len)
    batch = 64
    lens = [0] * batch
    r = {"first": 0, "middle": batch // 2, "last": batch - 1}[who]
    lens[r] = 5000
    q, kv, md, _ = paged(lens, 64, q_len=q_len, seed=r)
    out, lse = run_kernel(impl, q, kv, md)
    ref, ref_lse = reference(q, kv, md)
    assert_close_to_reference(out, lse, ref, ref_lse)
    assert torch.isneginf(lse).sum() == (batch - 1) * q_len * HEADS


def test_one_token_requests_beside_64k_ones():
    impl = kernel_or_skip()
    lens = [1, 65536, 1, 7, 65535, 1, 0, 64]
    q, kv, md, _ = paged(lens, 64, seed=5)
    assert_close_to_reference(*run_kernel(impl, q, kv, md), *reference(q, kv, md))


@pytest.mark.parametrize("batch", [256, 257])
@pytest.mark.mla_kernels(plans=(257,))
def test_batch_at_the_planners_max(batch):
    """A planner sized for exactly this batch (256 fills the plan kernel's smallest scan, 257 starts the next)."""
    impl = kernel_or_skip()
    g = torch.Generator().manual_seed(batch)
    lens = torch.randint(0, 700, (batch,), generator=g)
    lens[::7] = 0
    lens[-1] = 1
    q, kv, md, _ = paged(lens.tolist(), 64, seed=batch)
    planner = SplitPlanner(batch, HEADS, 1, "cuda")
    md.plan = planner.plan(md.kv_lens)
    assert_close_to_reference(*run_kernel(impl, q, kv, md), *reference(q, kv, md))


@pytest.mark.parametrize("lens", [[37, 300, 5], [5, 20000, 1]], ids=["short", "split"])
def test_nan_in_q_reaches_its_row(lens):
    """NaN in one (token, head) of q gives NaN in that output row (reference and kernel alike), not zeros; every
    other row is unchanged. 'split': the long request is cut into parts, so the NaN goes through the combine."""
    impl = kernel_or_skip()
    q, kv, md, _ = paged(lens, 64, seed=7)
    clean, clean_lse = run_kernel(impl, q, kv, md)
    q = q.clone()
    q[1, 3, 100] = float("nan")  # request 1 (the long one), head 3
    out, lse = run_kernel(impl, q, kv, md, poison=SENTINEL)
    ref, ref_lse = reference(q, kv, md)
    assert torch.isnan(ref[1, 3]).all() and torch.isnan(ref_lse[1, 3])  # the anchors' rule, in the reference
    assert torch.isnan(out[1, 3]).all(), "NaN in q did not reach its output row"
    keep = torch.ones(len(lens), HEADS, dtype=torch.bool, device="cuda")
    keep[1, 3] = False
    assert torch.equal(out[keep], clean[keep]) and torch.equal(lse[keep], clean_lse[keep])


def test_nan_in_a_visible_cache_row_reaches_its_request_only():
    impl = kernel_or_skip()
    lens = [300, 130, 9]
    q, kv, md, pages = paged(lens, 64, seed=8)
    kv = kv.clone()
    kv[pages[1][1], 10, 29] = float("nan")  # request 1, token 74, a latent column (in every score and the value)
    out, lse = run_kernel(impl, q, kv, md, poison=SENTINEL)
    ref, ref_lse = reference(q, kv, md)
    assert torch.isnan(ref[1]).all() and torch.isnan(ref_lse[1]).all()
    assert torch.isnan(out[1]).all(), "NaN in a visible cache row did not reach its request's output"
    for r in (0, 2):
        assert_close_to_reference(out[r: r + 1], lse[r: r + 1], ref[r: r + 1], ref_lse[r: r + 1])


@pytest.mark.parametrize("where", ["q", "cache"])
def test_nan_reaches_the_lse(where):
    impl = kernel_or_skip()
    lens = [5, 20000, 1]
    q, kv, md, pages = paged(lens, 64, seed=10)
    if where == "q":
        q = q.clone()
        q[1, 3, 100] = float("nan")
    else:
        kv = kv.clone()
        kv[pages[1][2], 0, 29] = float("nan")
    _, lse = run_kernel(impl, q, kv, md, poison=SENTINEL)
    _, ref_lse = reference(q, kv, md)
    rows = torch.isnan(ref_lse)
    assert rows.any()
    assert torch.isnan(lse[rows]).all(), f"kernel LSE {lse[rows][:4].tolist()} where the reference's is NaN"


def test_stale_nan_is_never_read():
    """NaN in the slots past each kv_len of the last page, in the block-table entries past each request's pages
    (they name a NaN page), and around the cache: none of it may reach the output (paged() poisons all three)."""
    impl = kernel_or_skip()
    lens = [1, 63, 65, 127, 200, 1000]
    q, kv, md, _ = paged(lens, 64, seed=9)
    assert_close_to_reference(*run_kernel(impl, q, kv, md), *reference(q, kv, md))
