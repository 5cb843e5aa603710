"""Property tests of the metadata constructors, the value checks and the reference op (hypothesis).

Strategy A builds engine-shaped batches: vLLM block tables (CUDA-graph padded rows with seq_len 0 and junk page
ids, rows wider than a request needs, rows of a larger persistent buffer), SGLang row-strided CSR page lists
gathered from a ``req_to_token`` table, FlashInfer compact CSR with ``kv_last_page_len``, page sizes 1..256,
empty requests, MTP (1..4 queries per request, causal), ragged query counts, pages in random order. Every such
batch must pass the value checks, and ``mla_decode`` on the CPU (the reference) must match a dense attention
written here, which gathers each request's tokens from the page lists it was built from.

Strategy B turns a valid batch into an invalid one (a length beyond its own pages, a decreasing ``kv_indptr``, a
``kv_last_page_len`` out of range, a page id outside the cache, a negative length, float or int64 index tensors, a
bad ``page_size`` or ``q_len``, ``qo_indptr`` against ``q_len``) and asserts :class:`MLAInputError` naming the
argument (and the request) at fault.

``MLA_FUZZ_EXAMPLES=N`` sets the number of examples per test (default: a quick run, < 60 s on 2 cores).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mla_backend import MLADecodeMetadata, MLAInputError, mla_decode
from mla_backend.constants import HEAD_DIM, KV_LORA_RANK, MAX_Q_LEN, SUPPORTED_PAGE_SIZES

SCALE = 192**-0.5
MAX_LEN = 300

settings.register_profile(
    "mla_backend_fuzz",
    max_examples=int(os.environ.get("MLA_FUZZ_EXAMPLES", "40")),
    deadline=None,  # the first example of a process pays torch's warm-up
    database=None,  # nothing written into the working tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
FUZZ = settings.get_profile("mla_backend_fuzz")
FUZZ_CHEAP = settings(FUZZ, max_examples=FUZZ.max_examples * 5 // 2)  # the refusals cost a few ms each


@dataclass
class Batch:
    """One engine-shaped batch: the constructor's arguments plus what the oracle needs (built apart from them)."""

    layout: str  # "vllm", "sglang" or "flashinfer"
    page_size: int
    lens: list[int]  # KV length per row (padded rows: 0)
    q_counts: list[int]  # queries per row
    pages: list[list[int]]  # the page ids each row uses, in token order
    num_pages: int  # cache pages
    kwargs: dict = field(default_factory=dict)
    seed: int = 0
    heads: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def num_tokens(self) -> int:
        return sum(self.q_counts)

    def metadata(self) -> MLADecodeMetadata:
        if self.layout == "vllm":
            return MLADecodeMetadata.from_block_table(**self.kwargs)
        return MLADecodeMetadata.from_csr(**self.kwargs)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        kv = torch.randn(self.num_pages, self.page_size, HEAD_DIM, generator=g).to(self.dtype)
        q = torch.randn(self.num_tokens, self.heads, HEAD_DIM, generator=g).to(self.dtype)
        return q, kv


def junk(g: torch.Generator, shape) -> torch.Tensor:
    """Stale page ids: anything, negative and huge included."""
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


@st.composite
def engine_batches(draw, max_batch: int = 4) -> Batch:
    layout = draw(st.sampled_from(["vllm", "sglang", "flashinfer"]))
    page_size = draw(st.sampled_from(SUPPORTED_PAGE_SIZES))
    real = draw(st.integers(0 if layout != "sglang" else 1, max_batch))
    padded = draw(st.integers(0, 3)) if layout != "flashinfer" or draw(st.booleans()) else 0
    ragged = draw(st.integers(0, 5)) == 0
    q_len = draw(st.integers(1, MAX_Q_LEN))
    near_page = st.sampled_from([1, page_size - 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 1])
    length = st.one_of(st.just(0), st.integers(1, MAX_LEN), near_page.filter(lambda n: 0 <= n <= MAX_LEN))
    lens = draw(st.lists(length, min_size=real, max_size=real)) + [0] * padded
    rows = len(lens)
    if ragged:
        q_counts = draw(st.lists(st.integers(0, MAX_Q_LEN), min_size=rows, max_size=rows))
    else:
        q_counts = [q_len] * rows  # padded rows keep their query slots (vLLM's uniform batches)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page_size) for n in lens]
    spare = draw(st.integers(0, 3))
    num_pages = sum(used) + spare
    perm = torch.randperm(num_pages, generator=g).tolist() if num_pages else []
    pages, at = [], 0
    for n in used:
        pages.append(perm[at: at + n])
        at += n
    index_dtype = draw(st.sampled_from([torch.int32, torch.int64]))  # SGLang's seq_lens are int64
    qo = torch.tensor([0] + [sum(q_counts[: r + 1]) for r in range(rows)], dtype=index_dtype)
    kwargs: dict = {"page_size": page_size}
    if ragged:
        kwargs["qo_indptr"] = qo
    elif draw(st.booleans()):  # an engine's persistent qo_indptr, with its uniform q_len
        kwargs.update(qo_indptr=qo, q_len=q_len)
    else:
        kwargs["q_len"] = q_len
    lens_t = torch.tensor(lens, dtype=index_dtype)

    if layout == "vllm":
        width = max(used + [0]) + draw(st.integers(0, 3))
        extra_rows, extra_cols = draw(st.integers(0, 2)), draw(st.integers(0, 5))
        big = junk(g, (rows + extra_rows, width + extra_cols))  # a persistent table: junk around the rows
        table = big[extra_rows: extra_rows + rows, :width]
        for r, p in enumerate(pages):
            table[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
        kwargs.update(block_table=table, seq_lens=lens_t.to(torch.int32) if draw(st.booleans()) else lens_t)
    elif layout == "sglang":
        # req_to_token: token slots (page * page_size + offset) per pool row; the page table is gathered from it.
        width = max(used + [1]) + draw(st.integers(0, 2))
        pool_rows = rows + draw(st.integers(0, 3))
        req_to_token = junk(g, (pool_rows, width * page_size)).abs()
        pool_index = torch.randperm(pool_rows, generator=g)[:rows]
        for r, p in enumerate(pages):
            for t in range(lens[r]):
                req_to_token[pool_index[r], t] = p[t // page_size] * page_size + t % page_size
        table = junk(g, (rows, width))
        for r, n in enumerate(used):
            cols = torch.arange(n) * page_size
            table[r, :n] = torch.div(req_to_token[pool_index[r], cols], page_size, rounding_mode="floor")
        kv_indptr = torch.arange(rows + 1, dtype=torch.int32) * table.stride(0)
        kwargs.update(kv_indptr=kv_indptr, kv_indices=table.view(-1), kv_lens=lens_t)
    else:  # FlashInfer: compact CSR, the last page's fill, junk after the last request's pages
        indptr = torch.tensor([0] + [sum(used[: r + 1]) for r in range(rows)], dtype=index_dtype)
        tail = draw(st.integers(0, 3))
        indices = torch.cat([torch.tensor([i for p in pages for i in p], dtype=torch.int32), junk(g, (tail,))])
        last = [(n - 1) % page_size + 1 if n else draw(st.integers(0, page_size)) for n in lens]
        kwargs.update(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=torch.tensor(last, dtype=index_dtype))
    heads = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    return Batch(layout, page_size, lens, q_counts, pages, num_pages, kwargs, seed, heads, dtype)


def dense_attention(b: Batch, q: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 softmax attention, token by token from each row's own page list (docs/api.md's causal rule: query i of
    s_q sees positions < kv_len - s_q + i + 1; nothing visible gives zeros and LSE -inf)."""
    flat = kv_cache.reshape(-1, HEAD_DIM).double()
    out = torch.zeros(b.num_tokens, b.heads, KV_LORA_RANK, dtype=torch.float64)
    lse = torch.full((b.num_tokens, b.heads), -math.inf, dtype=torch.float64)
    tok = 0
    for r, (kv_len, s_q) in enumerate(zip(b.lens, b.q_counts)):
        rows = [b.pages[r][t // b.page_size] * b.page_size + t % b.page_size for t in range(kv_len)]
        kv = flat[rows]
        for i in range(s_q):
            seen = kv_len - s_q + i + 1
            if seen > 0:
                scores = q[tok + i].double() @ kv[:seen].T * SCALE  # [H, seen]
                lse[tok + i] = torch.logsumexp(scores, -1)
                out[tok + i] = torch.softmax(scores, -1) @ kv[:seen, :KV_LORA_RANK]
        tok += s_q
    return out, lse


# ---------------------------------------------------------------------------------------------- strategy A
@FUZZ
@given(engine_batches())
def test_engine_batches_pass_the_checks_and_match_dense_attention(b: Batch):
    md = b.metadata()
    assert md.q_len == (None if "q_len" not in b.kwargs else b.kwargs["q_len"])
    assert md.kv_lens.tolist() == b.lens
    md.check(num_cache_pages=b.num_pages, num_tokens=b.num_tokens)  # no false alarm on an engine's batch
    q, kv_cache = b.tensors()
    out, lse = mla_decode(q, kv_cache, md, SCALE, return_lse=True)
    ref_out, ref_lse = dense_attention(b, q, kv_cache)
    assert out.shape == (b.num_tokens, b.heads, KV_LORA_RANK) and out.dtype == b.dtype
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows that see nothing differ"
    tol = 1e-4 if b.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * 0.1)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=0, atol=1e-4)
    blind = torch.isneginf(ref_lse)
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))


# ---------------------------------------------------------------------------------------------- strategy B
MUTATIONS = ["beyond_own_pages", "negative_length", "decreasing_indptr", "indptr_not_from_zero", "last_page_len",
             "page_id", "float_index", "int64_table", "page_size", "q_len", "qo_vs_q_len"]


def mutate(b: Batch, kind: str, data) -> str:
    """Makes ``b`` invalid in one way; returns the regex its error message must match."""
    kw = b.kwargs
    rows = len(b.lens)
    p = b.page_size
    k = data.draw(st.integers(1, 3 * p), label="k")
    if kind == "beyond_own_pages":
        assume(b.layout != "flashinfer" and rows)
        r = data.draw(st.integers(0, rows - 1), label="r")
        if b.layout == "vllm":
            own = kw["block_table"].shape[1]
            kw["seq_lens"] = kw["seq_lens"].clone()
            kw["seq_lens"][r] = own * p + k
            return rf"metadata\.kv_lens\[{r}\]={own * p + k} \(seq_lens of from_block_table\).*block_table row"
        own = int(kw["kv_indptr"][r + 1] - kw["kv_indptr"][r])
        kw["kv_lens"] = kw["kv_lens"].clone()
        kw["kv_lens"][r] = own * p + k
        return rf"metadata\.kv_lens\[{r}\]={own * p + k} \(kv_lens of from_csr\).*kv_indptr\[{r + 1}\] - kv_indptr\[{r}\]"
    if kind == "negative_length":
        assume(b.layout != "flashinfer" and rows)
        r = data.draw(st.integers(0, rows - 1), label="r")
        name = "seq_lens" if b.layout == "vllm" else "kv_lens"
        kw[name] = kw[name].clone()
        kw[name][r] = -k
        return rf"metadata\.kv_lens\[{r}\]=-{k} .*non-negative"
    if kind == "decreasing_indptr":
        assume(b.layout != "vllm" and rows)
        r = data.draw(st.integers(1, rows), label="r")
        kw["kv_indptr"] = kw["kv_indptr"].clone()
        kw["kv_indptr"][r] = kw["kv_indptr"][r - 1] - k
        return r"kv_indptr=\[.*non-decreasing from 0"
    if kind == "indptr_not_from_zero":
        assume(b.layout != "vllm")
        kw["kv_indptr"] = kw["kv_indptr"] + k
        return r"kv_indptr=\[.*non-decreasing from 0"
    if kind == "last_page_len":
        assume(b.layout == "flashinfer" and rows)
        r = data.draw(st.integers(0, rows - 1), label="r")
        has_pages = int(kw["kv_indptr"][r + 1] - kw["kv_indptr"][r]) > 0
        bad = data.draw(st.sampled_from([p + k, -k] + ([0] if has_pages else [])), label="bad")
        kw["kv_last_page_len"] = kw["kv_last_page_len"].clone()
        kw["kv_last_page_len"][r] = bad
        return rf"kv_last_page_len\[{r}\]={bad} .*1\.\.page_size={p}"
    if kind == "page_id":
        readers = [r for r in range(rows) if b.pages[r]]
        assume(readers)
        r = data.draw(st.sampled_from(readers), label="r")
        j = data.draw(st.integers(0, len(b.pages[r]) - 1), label="j")
        bad = data.draw(st.sampled_from([b.num_pages, b.num_pages + k, -k, 2**31 - 1]), label="bad")
        if b.layout == "vllm":
            kw["block_table"][r, j] = bad  # in place: the table may be a slice of a larger buffer
        else:
            kw["kv_indices"][int(kw["kv_indptr"][r]) + j] = bad
        return rf"metadata\.page_table=entry {bad} \(read by request {r}\).*num_pages={b.num_pages}"
    if kind == "float_index":
        names = [n for n in ("seq_lens", "kv_lens", "kv_last_page_len", "kv_indptr", "qo_indptr") if n in kw]
        name = data.draw(st.sampled_from(names), label="name")
        dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bool]), label="dtype")
        kw[name] = kw[name].to(dtype)
        return rf"{name} must be an int32 tensor \(int64 is converted\), got {re.escape(str(dtype))}"
    if kind == "int64_table":
        name = "block_table" if b.layout == "vllm" else "kv_indices"
        kw[name] = kw[name].long()
        return rf"{name} must be int32, got torch\.int64"
    if kind == "page_size":
        kw["page_size"] = data.draw(st.one_of(
            st.integers(max_value=0), st.integers(1, 4096).filter(lambda n: n & (n - 1)),
            st.floats(allow_nan=True), st.booleans(), st.just(str(p)), st.just(None)), label="page_size")
        return r"page_size=.* is not supported; expected a positive power of two"
    if kind == "q_len":
        assume("q_len" in kw)
        kw["q_len"] = data.draw(st.one_of(
            st.integers(max_value=0), st.integers(MAX_Q_LEN + 1, 10**6), st.floats(allow_nan=True), st.booleans()),
            label="q_len")
        return rf"q_len=.* is not supported; expected an int in 1\.\.{MAX_Q_LEN}"
    if kind == "qo_vs_q_len":
        assume("qo_indptr" in kw and "q_len" in kw and rows >= 2)
        r = data.draw(st.integers(0, rows - 2), label="r")
        qo = kw["qo_indptr"].clone()
        qo[r + 1] += data.draw(st.sampled_from([-1, 1]), label="shift")  # total unchanged: only the split differs
        kw["qo_indptr"] = qo
        return r"metadata\.qo_indptr=\[.*\(request \d+ has \d+ queries\).*q_len=" + str(kw["q_len"])
    raise AssertionError(kind)


@FUZZ_CHEAP
@given(engine_batches(max_batch=3), st.sampled_from(MUTATIONS), st.data())
def test_invalid_metadata_is_refused_by_name(b: Batch, kind: str, data):
    want = mutate(b, kind, data)
    q, kv_cache = b.tensors()
    with pytest.raises(MLAInputError) as err:
        md = b.metadata()
        mla_decode(q, kv_cache, md, SCALE)  # check_indices defaults to on (no CUDA-graph capture here)
    assert re.search(want, str(err.value)), f"{kind}: {err.value!s} does not match {want!r}"


@FUZZ_CHEAP
@given(engine_batches(max_batch=3), st.sampled_from(["beyond_own_pages", "page_id", "decreasing_indptr"]), st.data())
def test_md_check_refuses_what_mla_decode_refuses(b: Batch, kind: str, data):
    """MLADecodeMetadata.check runs the same value checks (for engines: once per step, outside CUDA graphs)."""
    want = mutate(b, kind, data)
    md = b.metadata()
    with pytest.raises(MLAInputError, match=want):
        md.check(num_cache_pages=b.num_pages, num_tokens=b.num_tokens)
