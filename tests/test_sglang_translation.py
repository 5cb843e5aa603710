"""CPU tests of the SGLang adapter's page-table translation and metadata assembly (no sglang import).

A random SGLang-style pool is built (``req_to_token`` rows filled from randomly allocated pages,
slot = page * page_size + offset, page 0 reserved as SGLang's dummy page), translated with the
exact functions the SGLang backend uses, and ``mla_decode`` (reference path on CPU) is compared
with a naive attention computed directly from the ``req_to_token`` token slots.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mla_backend import MLADecodeMetadata, mla_decode
from mla_backend.sglang_plugin.page_table import (
    fill_page_table_torch,
    max_pages_per_request,
    num_pages,
    sglang_decode_metadata,
    translate_page_table,
)

KV_LORA_RANK, ROPE_DIM, HEAD_DIM = 512, 64, 576


class SGLangPool:
    """A minimal stand-in for SGLang's ReqToTokenPool + paged MLATokenToKVPool."""

    def __init__(self, page_size: int, total_lens: list[int], *, max_context_len: int, num_heads: int = 4,
                 extra_pages: int = 7, kv_dtype=torch.float32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        self.num_heads = num_heads
        bs = len(total_lens)
        pages_needed = sum(-(-n // page_size) for n in total_lens)
        self.num_pages = 1 + pages_needed + extra_pages  # page 0 = SGLang's padded dummy page
        # MLATokenToKVPool keeps [size + page_size, 1, 576]; the op reads it as [pages, page_size, 576].
        kv = torch.randn(self.num_pages * page_size, 1, HEAD_DIM, generator=g)
        self.kv_buffer = kv.to(kv_dtype) if kv_dtype != torch.float8_e4m3fn else (kv * 0.5).to(kv_dtype)
        rows = bs + 3
        # Stale garbage beyond each request's length (SGLang never clears rows).
        self.req_to_token = torch.randint(0, self.num_pages * page_size, (rows, max_context_len),
                                          dtype=torch.int32, generator=g)
        self.req_pool_indices = torch.randperm(rows - 1, generator=g)[:bs] + 1  # row 0 is the padding row
        free = (torch.randperm(self.num_pages - 1, generator=g) + 1).tolist()
        for r, n in enumerate(total_lens):
            row = int(self.req_pool_indices[r])
            for j in range(-(-n // page_size)):
                page = free.pop()
                for t in range(j * page_size, min(n, (j + 1) * page_size)):
                    self.req_to_token[row, t] = page * page_size + (t % page_size)

    def paged_cache(self) -> torch.Tensor:
        return self.kv_buffer.view(-1, self.page_size, HEAD_DIM)


def naive_attention(pool: SGLangPool, q: torch.Tensor, total_lens: list[int], s_q: int, scale: float,
                    k_scale: float = 1.0) -> torch.Tensor:
    """Attention straight from req_to_token token slots (no pages involved)."""
    flat = pool.kv_buffer.view(-1, HEAD_DIM).float() * k_scale
    outs = []
    for r, n in enumerate(total_lens):
        slots = pool.req_to_token[int(pool.req_pool_indices[r]), :n].long()
        kv = flat[slots]  # [n, 576]
        for i in range(s_q):
            visible = n - s_q + i + 1
            qi = q[r * s_q + i].float()  # [H, 576]
            scores = (qi @ kv[:visible].T) * scale  # [H, visible]
            outs.append(torch.softmax(scores, dim=-1) @ kv[:visible, :KV_LORA_RANK])
    return torch.stack(outs)


def ragged_lens(page_size: int, bs: int, seed: int, max_len: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    special = [1, page_size, page_size + 1, 2 * page_size - 1, 3 * page_size]
    lens = [min(max_len, s) for s in special]
    while len(lens) < bs:
        lens.append(int(torch.randint(1, max_len + 1, (1,), generator=g)))
    return lens[:bs]


# ----------------------------------------------------------------------------- translation


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_translate_page_ids(page_size):
    lens = ragged_lens(page_size, 9, seed=page_size, max_len=5 * page_size + 3)
    pool = SGLangPool(page_size, lens, max_context_len=6 * page_size + 8, seed=1)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    kv_indptr, kv_indices = translate_page_table(pool.req_to_token, pool.req_pool_indices, kv_lens, page_size)
    width = max_pages_per_request(max(lens), page_size)
    assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
    assert kv_indptr.tolist() == [r * width for r in range(len(lens) + 1)]
    for r, n in enumerate(lens):
        row = int(pool.req_pool_indices[r])
        got = kv_indices[int(kv_indptr[r]): int(kv_indptr[r]) + -(-n // page_size)]
        want = pool.req_to_token[row, : n : page_size] // page_size
        assert torch.equal(got, want.to(torch.int32)), (r, n)
        # unused entries point at the dummy page, never at stale ids
        assert int(kv_indices[int(kv_indptr[r]) + -(-n // page_size): int(kv_indptr[r + 1])].abs().sum()) == 0
    assert torch.equal(num_pages(kv_lens, page_size), (kv_lens + page_size - 1) // page_size)


def test_translate_into_persistent_buffer_row_slice():
    """A [max_bs, W] buffer reused across steps: row stride = W, rows beyond bs untouched."""
    page_size, lens = 16, [5, 40, 16, 1]
    pool = SGLangPool(page_size, lens, max_context_len=128, seed=2)
    buf = torch.full((8, 8), -7, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    kv_indptr, kv_indices = translate_page_table(pool.req_to_token, pool.req_pool_indices, kv_lens, page_size,
                                                 out=buf)
    assert kv_indptr.tolist() == [0, 8, 16, 24, 32]
    assert kv_indices.data_ptr() == buf.data_ptr() and kv_indices.numel() == buf.numel()
    assert (buf[len(lens):] == -7).all()
    for r, n in enumerate(lens):
        want = pool.req_to_token[int(pool.req_pool_indices[r]), :n:page_size] // page_size
        assert torch.equal(buf[r, : want.numel()], want)


def test_translate_rejects_width_beyond_req_to_token():
    pool = SGLangPool(16, [10], max_context_len=32, seed=3)
    with pytest.raises(ValueError, match="exceeds req_to_token"):
        translate_page_table(pool.req_to_token, pool.req_pool_indices, torch.tensor([10], dtype=torch.int32), 16,
                             width=3)


def test_translate_empty_batch():
    pool = SGLangPool(16, [10], max_context_len=32, seed=3)
    kv_indptr, _ = translate_page_table(pool.req_to_token, pool.req_pool_indices[:0],
                                        torch.zeros(0, dtype=torch.int32), 16, width=2)
    assert kv_indptr.tolist() == [0]


# ----------------------------------------------------------------------------- decode vs naive


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [4, 16])
def test_decode_matches_naive_attention(page_size, num_heads):
    lens = ragged_lens(page_size, 7, seed=10 + page_size, max_len=4 * page_size + 5)
    pool = SGLangPool(page_size, lens, max_context_len=5 * page_size + 8, num_heads=num_heads, seed=4)
    seq_lens = torch.tensor(lens, dtype=torch.int64)  # SGLang's seq_lens are int64
    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, seq_lens, page_size)
    assert md.q_len == 1 and md.kv_lens.tolist() == lens
    q = torch.randn(len(lens), num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    scale = 192 ** -0.5
    out = mla_decode(q, pool.paged_cache(), md, scale)
    torch.testing.assert_close(out, naive_attention(pool, q, lens, 1, scale), atol=2e-5, rtol=2e-5)
    # The split (q_nope, q_pe) form DeepSeek can hand over gives the same result.
    out_split = mla_decode((q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]), pool.paged_cache(), md, scale)
    torch.testing.assert_close(out_split, out)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("s_q", [2, 3, 4])
def test_target_verify_causal_matches_naive(page_size, s_q):
    """TARGET_VERIFY: SGLang's seq_lens exclude the drafts, whose slots follow in req_to_token."""
    prefix = ragged_lens(page_size, 6, seed=20 + s_q, max_len=3 * page_size + 2)
    prefix[0] = 0  # a request whose only KV is the drafts themselves
    total = [p + s_q for p in prefix]
    pool = SGLangPool(page_size, total, max_context_len=4 * page_size + 16, seed=6)
    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, torch.tensor(prefix), page_size,
                                num_draft_tokens=s_q)
    assert md.q_len == s_q
    assert md.qo_indptr.tolist() == [r * s_q for r in range(len(prefix) + 1)]
    assert md.kv_lens.tolist() == total
    q = torch.randn(len(prefix) * s_q, 4, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    scale = 0.0721
    out = mla_decode(q, pool.paged_cache(), md, scale)
    torch.testing.assert_close(out, naive_attention(pool, q, total, s_q, scale), atol=2e-5, rtol=2e-5)


def test_persistent_buffers_refill_like_cuda_graph_replay():
    """Two steps through the same persistent buffers (what a captured graph reads): the metadata
    tensors keep their storage and the second step sees the second batch, incl. a padded request."""
    page_size, max_bs, max_ctx, s_q = 16, 6, 160, 1
    width = max_pages_per_request(max_ctx, page_size)
    page_table = torch.zeros(max_bs, width, dtype=torch.int32)
    kv_indptr = torch.arange(max_bs + 1, dtype=torch.int32) * width
    kv_lens = torch.ones(max_bs, dtype=torch.int32)
    qo_indptr = torch.arange(max_bs + 1, dtype=torch.int32) * s_q
    ptrs = None
    for step, lens in enumerate([[33, 1, 16, 80], [7, 150, 17, 64]]):
        pool = SGLangPool(page_size, lens, max_context_len=max_ctx, seed=30 + step)
        # pad the batch to max_bs like SGLang's graph runner: request row 0, seq_len fill value 1
        pad = max_bs - len(lens)
        req = torch.cat([pool.req_pool_indices, torch.zeros(pad, dtype=torch.int64)])
        pool.req_to_token[0].zero_()
        seq = torch.tensor(lens + [1] * pad)
        md = sglang_decode_metadata(pool.req_to_token, req, seq, page_size, page_table=page_table,
                                    kv_indptr=kv_indptr, kv_lens=kv_lens, qo_indptr=qo_indptr)
        now = (md.page_table.data_ptr(), md.kv_lens.data_ptr(), md.page_table_start.data_ptr(),
               md.qo_indptr.data_ptr())
        assert now == (page_table.data_ptr(), kv_lens.data_ptr(), kv_indptr.data_ptr(), qo_indptr.data_ptr())
        ptrs = ptrs or now
        assert now == ptrs
        assert md.q_len == s_q and md.batch_size == max_bs
        q = torch.randn(max_bs, 4, HEAD_DIM, generator=torch.Generator().manual_seed(step))
        out = mla_decode(q, pool.paged_cache(), md, 0.1)
        torch.testing.assert_close(out[: len(lens)], naive_attention(pool, q, lens, 1, 0.1), atol=2e-5, rtol=2e-5)
        assert torch.isfinite(out).all()  # padded rows read the dummy page 0


def test_custom_fill_is_used_and_only_used_pages_matter():
    """The backend swaps in SGLang's Triton page-table kernel, which leaves unused entries as they
    were; garbage there must not change the result."""
    page_size, lens = 16, [3, 47, 16]
    pool = SGLangPool(page_size, lens, max_context_len=64, seed=8)
    calls = []

    def sloppy_fill(req_to_token, req_pool_indices, kv_lens, page_size_, out):
        calls.append(tuple(out.shape))
        out.fill_(12345)  # garbage everywhere first
        for r in range(out.shape[0]):
            n = -(-int(kv_lens[r]) // page_size_)
            out[r, :n] = req_to_token[int(req_pool_indices[r]), : n * page_size_ : page_size_] // page_size_

    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, torch.tensor(lens), page_size,
                                width=4, fill=sloppy_fill)
    assert calls == [(3, 4)]
    q = torch.randn(3, 4, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(mla_decode(q, pool.paged_cache(), md, 0.1),
                               naive_attention(pool, q, lens, 1, 0.1), atol=2e-5, rtol=2e-5)


def test_fp8_cache_with_k_scale():
    """SGLang stores fp8 KV as a plain cast; the op dequantises with k_scale (1.0 when none)."""
    page_size, lens = 16, [20, 1, 33]
    pool = SGLangPool(page_size, lens, max_context_len=64, kv_dtype=torch.float8_e4m3fn, seed=11)
    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, torch.tensor(lens), page_size)
    q = torch.randn(3, 4, HEAD_DIM, generator=torch.Generator().manual_seed(12))
    for k_scale in (1.0, 0.5):
        out = mla_decode(q, pool.paged_cache(), md, 0.1, k_scale=k_scale)
        torch.testing.assert_close(out, naive_attention(pool, q, lens, 1, 0.1, k_scale=k_scale),
                                   atol=1e-4, rtol=1e-4)


def test_bf16_decode():
    page_size, lens = 64, [65, 3, 128, 200]
    pool = SGLangPool(page_size, lens, max_context_len=256, kv_dtype=torch.bfloat16, seed=13)
    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, torch.tensor(lens), page_size)
    q = torch.randn(4, 16, HEAD_DIM, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    out = mla_decode(q, pool.paged_cache(), md, 192 ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive_attention(pool, q, lens, 1, 192 ** -0.5), atol=2e-2, rtol=2e-2)


def test_metadata_is_canonical_csr():
    page_size, lens = 16, [17, 2]
    pool = SGLangPool(page_size, lens, max_context_len=64, seed=15)
    md = sglang_decode_metadata(pool.req_to_token, pool.req_pool_indices, torch.tensor(lens), page_size)
    assert isinstance(md, MLADecodeMetadata)
    assert md.page_size == page_size
    for t in (md.kv_lens, md.qo_indptr, md.page_table, md.page_table_start):
        assert t.dtype == torch.int32
    # row-strided: width = ceil(max(kv_lens) / page_size) = 2 when no width is given
    assert md.page_table_start.tolist() == [0, 2]


def test_fill_reference_zeroes_unused():
    page_size, lens = 1, [3, 1]
    pool = SGLangPool(page_size, lens, max_context_len=8, seed=16)
    out = torch.full((2, 4), 99, dtype=torch.int32)
    fill_page_table_torch(pool.req_to_token, pool.req_pool_indices, torch.tensor(lens), page_size, out)
    assert out[0, 3] == 0 and (out[1, 1:] == 0).all()
    assert out[1, 0] == pool.req_to_token[int(pool.req_pool_indices[1]), 0]


# ----------------------------------------------------------------------------- plugin module hygiene


def test_plugin_import_is_cheap_and_sglang_free():
    """Importing the plugin package (what SGLang's entry-point loader does) pulls in neither sglang
    nor tilelang; only register() touches SGLang."""
    import os
    import subprocess

    code = (
        "import sys, mla_backend.sglang_plugin as p\n"
        "assert p.BACKEND_NAME == 'tilelang_mla' and callable(p.register)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'tilelang')]\n"
        "assert not bad, bad\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
