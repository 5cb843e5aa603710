"""Random paged MLA problems and an independent dense fp64 oracle, shared by the CPU tests.

The oracle gathers each request's KV token by token from its own list of page ids, so it shares no
code with the library's metadata or reference implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mla_backend import MLADecodeMetadata

LATENT, ROPE, HEAD = 512, 64, 576
SCALE = 192**-0.5  # DeepSeek-V3's softmax scale (without the yarn factor)


@dataclass
class Problem:
    """q ``[T, H, 576]``; kv_cache ``[num_pages, page_size, 576]``; pages[r]: page ids of request r."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    lens: list[int]
    q_lens: list[int]
    pages: list[list[int]]
    page_size: int

    @property
    def qo_indptr(self) -> torch.Tensor:
        """int32 ``[batch + 1]``."""
        return torch.tensor([0] + list(_cumsum(self.q_lens)), dtype=torch.int32)

    def block_table(self, pad: int = 2, fill: int = -1) -> torch.Tensor:
        """Padded int32 ``[batch, max_pages + pad]``; entries past a request's pages are ``fill``."""
        width = max([len(p) for p in self.pages] + [0]) + pad
        table = torch.full((len(self.lens), width), fill, dtype=torch.int32)
        for r, p in enumerate(self.pages):
            table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
        return table

    def csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr ``[batch + 1]``, kv_indices ``[total_pages]``, kv_last_page_len ``[batch]``), int32."""
        indptr = torch.tensor([0] + list(_cumsum(len(p) for p in self.pages)), dtype=torch.int32)
        indices = torch.tensor([i for p in self.pages for i in p], dtype=torch.int32)
        # FlashInfer: 1..page_size in the last page; requests with no page carry an arbitrary value.
        last = torch.tensor([(n - 1) % self.page_size + 1 if n else 0 for n in self.lens], dtype=torch.int32)
        return indptr, indices, last

    def metadata(self) -> MLADecodeMetadata:
        """From the padded block table (uniform q_len) or with qo_indptr (ragged)."""
        lens = torch.tensor(self.lens, dtype=torch.int32)
        if len(set(self.q_lens)) == 1 and self.q_lens:
            return MLADecodeMetadata.from_block_table(self.block_table(), lens, self.page_size, q_len=self.q_lens[0])
        return MLADecodeMetadata.from_block_table(self.block_table(), lens, self.page_size, qo_indptr=self.qo_indptr)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def make_problem(lens, heads: int, q_len, page_size: int, dtype=torch.bfloat16, kv_dtype=None, seed: int = 0,
                 spare_pages: int = 3) -> Problem:
    """Random q and cache (never zeros); each request's pages are a random, scattered subset of the cache.

    q_len: an int (uniform) or a list with one query count per request.
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = [q_len] * len(lens) if isinstance(q_len, int) else list(q_len)
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages, used = [], 0
    for n in counts:
        pages.append(perm[used: used + n])
        used += n
    kv = torch.randn(num_pages, page_size, HEAD, generator=g)
    kv_cache = kv.to(kv_dtype or dtype)
    q = torch.randn(sum(q_lens), heads, HEAD, generator=g).to(dtype)
    return Problem(q, kv_cache, list(lens), q_lens, pages, page_size)


def naive_attention(p: Problem, scale: float = SCALE, k_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense softmax attention in fp64: out ``[T, H, 512]`` and natural-log lse ``[T, H]``.

    Query i of a request with s_q queries and kv_len tokens sees positions ``< kv_len - s_q + i + 1``;
    a query that sees nothing gives zeros and lse -inf.
    """
    flat = p.kv_cache.reshape(-1, HEAD)
    num_tokens, heads, _ = p.q.shape
    out = torch.zeros(num_tokens, heads, LATENT, dtype=torch.float64)
    lse = torch.full((num_tokens, heads), -math.inf, dtype=torch.float64)
    tok = 0
    for r, (kv_len, s_q) in enumerate(zip(p.lens, p.q_lens)):
        rows = [p.pages[r][t // p.page_size] * p.page_size + t % p.page_size for t in range(kv_len)]
        kv = flat[rows].double() * k_scale  # [kv_len, 576]
        for i in range(s_q):
            seen = min(kv_len - s_q + i + 1, kv_len)
            if seen > 0:
                scores = p.q[tok + i].double() @ kv[:seen].T * scale  # [H, seen]
                lse[tok + i] = torch.logsumexp(scores, dim=-1)
                out[tok + i] = torch.softmax(scores, dim=-1) @ kv[:seen, :LATENT]
        tok += s_q
    return out, lse


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    """out (``dtype``) against the fp64 oracle: one rounding of the output, fp32 accumulation."""
    assert out.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "the -inf LSE pattern differs"
    rtol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=rtol * 0.1)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=0, atol=1e-4)


def fill_plan(plan, blocks, starts):
    """Write the cut ``starts`` ([num_parts + 1]) of requests of ``blocks`` into ``plan`` as the plan kernel does:
    cu_blocks, each part's first and last request, each request's first part and number of parts."""
    cu = [0]
    for n in blocks:
        cu.append(cu[-1] + n)
    for part, (lo, hi) in enumerate(zip(starts, starts[1:])):
        touched = [r for r in range(len(blocks)) if max(lo, cu[r]) < min(hi, cu[r + 1])]
        first = next(r for r in range(len(blocks) + 1) if r == len(blocks) or cu[r + 1] > lo)
        plan.part_begin_req[part] = touched[0] if touched else first
        plan.part_end_req[part] = touched[-1] if touched else first - 1
    for r in range(len(blocks)):
        parts = [p for p, (lo, hi) in enumerate(zip(starts, starts[1:])) if max(lo, cu[r]) < min(hi, cu[r + 1])]
        plan.req_parts[2 * r], plan.req_parts[2 * r + 1] = (parts[0], len(parts)) if parts else (0, 0)
    plan.cu_blocks[: len(cu)] = torch.tensor(cu, dtype=torch.int32)
    plan.part_start.copy_(torch.tensor(starts, dtype=torch.int32))
    return plan
