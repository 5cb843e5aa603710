"""Canonical metadata: the vLLM block-table and SGLang/FlashInfer CSR layouts describe the same attention,
without copying the engine's tables."""

from __future__ import annotations

import pytest
import torch

from mla_backend import MLADecodeMetadata, mla_decode
from mla_problems import SCALE, assert_matches, make_problem, naive_attention

LENS = [0, 1, 16, 17, 50, 0, 129]


def run(p, md):
    return mla_decode(p.q, p.kv_cache, md, SCALE, return_lse=True)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_len", [1, 2])
def test_block_table_and_csr_agree(page_size, q_len):
    p = make_problem(LENS, 16, q_len, page_size, seed=page_size + q_len)
    lens = torch.tensor(p.lens, dtype=torch.int32)
    indptr, indices, last = p.csr()
    variants = {
        "block_table": MLADecodeMetadata.from_block_table(p.block_table(), lens, page_size, q_len=q_len),
        "csr+last_page_len": MLADecodeMetadata.from_csr(indptr, indices, page_size, kv_last_page_len=last,
                                                        q_len=q_len),
        "csr+kv_lens": MLADecodeMetadata.from_csr(indptr, indices, page_size, kv_lens=lens, q_len=q_len),
    }
    results = {name: run(p, md) for name, md in variants.items()}
    out0, lse0 = results["block_table"]
    for name, (out, lse) in results.items():
        assert torch.equal(out, out0) and torch.equal(lse, lse0), name
    assert_matches(out0, lse0, *naive_attention(p), torch.bfloat16)


def test_csr_last_page_len_gives_kv_lens():
    p = make_problem(LENS, 1, 1, 16, seed=1)
    indptr, indices, last = p.csr()
    md = MLADecodeMetadata.from_csr(indptr, indices, 16, kv_last_page_len=last)
    assert md.kv_lens.tolist() == p.lens
    assert md.num_pages().tolist() == [len(x) for x in p.pages]
    assert md.page_table_start.tolist() == indptr[:-1].tolist()
    assert md.page_table.data_ptr() == indices.data_ptr()  # kv_indices used in place


def test_block_table_rows_of_a_larger_buffer_are_not_copied():
    """vLLM hands a [:batch, :max_pages] slice of a persistent [max_batch, max_blocks] table."""
    p = make_problem(LENS, 16, 1, 16, seed=2)
    table = p.block_table(pad=0)
    batch, width = table.shape
    big = torch.randint(-5, 10**6, (batch + 4, width + 7), dtype=torch.int32)  # garbage around the rows
    big[2: 2 + batch, :width] = table
    rows = big[2: 2 + batch, :width]
    assert rows.stride(0) > rows.shape[1]
    md = MLADecodeMetadata.from_block_table(rows, torch.tensor(p.lens, dtype=torch.int32), 16)
    assert md.page_table.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
    assert md.page_table.data_ptr() == rows.data_ptr()
    assert md.page_table_start.tolist() == [r * big.stride(0) for r in range(batch)]
    out, lse = run(p, md)
    assert_matches(out, lse, *naive_attention(p), torch.bfloat16)
    dense = MLADecodeMetadata.from_block_table(table, torch.tensor(p.lens, dtype=torch.int32), 16)
    out2, lse2 = run(p, dense)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_padding_past_each_request_is_never_read():
    """Entries past ceil(kv_len / page_size) may hold anything (vLLM leaves stale ids there)."""
    p = make_problem(LENS, 16, 1, 16, seed=3)
    lens = torch.tensor(p.lens, dtype=torch.int32)
    clean = run(p, MLADecodeMetadata.from_block_table(p.block_table(fill=0), lens, 16))
    dirty = run(p, MLADecodeMetadata.from_block_table(p.block_table(fill=10**6), lens, 16))
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


def test_ragged_qo_indptr_in_both_layouts():
    p = make_problem([9, 0, 33], 16, [2, 1, 3], 16, seed=4)
    lens = torch.tensor(p.lens, dtype=torch.int32)
    indptr, indices, _ = p.csr()
    a = MLADecodeMetadata.from_block_table(p.block_table(), lens, 16, qo_indptr=p.qo_indptr)
    b = MLADecodeMetadata.from_csr(indptr, indices, 16, kv_lens=lens, qo_indptr=p.qo_indptr)
    assert a.q_len is None and b.q_len is None
    ra, rb = run(p, a), run(p, b)
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])
    assert_matches(*ra, *naive_attention(p), torch.bfloat16)


def test_uniform_q_len_defaults():
    md = MLADecodeMetadata.from_block_table(torch.zeros(3, 2, dtype=torch.int32), torch.tensor([1, 2, 3]), 16,
                                            q_len=2)
    assert md.q_len == 2 and md.qo_indptr.tolist() == [0, 2, 4, 6]
    assert md.kv_lens.dtype == torch.int32 and md.batch_size == 3
    assert md.to("cpu").page_table.tolist() == md.page_table.tolist()


def test_empty_batch():
    md = MLADecodeMetadata.from_block_table(torch.zeros(0, 4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                            16)
    q = torch.randn(0, 16, 576).bfloat16()
    out, lse = mla_decode(q, torch.randn(2, 16, 576).bfloat16(), md, SCALE, return_lse=True)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


def test_constructors_keep_their_layout_for_the_value_checks():
    """The block table's width and kv_indptr / kv_last_page_len are kept by reference (no copy, no device op),
    through md.to() too, so check_indices can hold each request to its own pages."""
    p = make_problem(LENS, 1, 1, 16, seed=5)
    lens = torch.tensor(p.lens, dtype=torch.int32)
    table = p.block_table(pad=3)
    md = MLADecodeMetadata.from_block_table(table, lens, 16)
    assert md.source.layout == "block_table" and md.source.row_pages == table.shape[1]
    assert md.to("cpu").source.row_pages == table.shape[1]
    indptr, indices, last = p.csr()
    md = MLADecodeMetadata.from_csr(indptr, indices, 16, kv_last_page_len=last)
    assert md.source.layout == "csr" and md.source.kv_indptr is indptr and md.source.kv_last_page_len is last
    moved = md.to("cpu")
    assert moved.source.kv_indptr.tolist() == indptr.tolist() and moved.source.kv_last_page_len.tolist() == last.tolist()
    moved.check(num_cache_pages=p.kv_cache.shape[0], num_tokens=len(LENS))
    direct = MLADecodeMetadata(md.kv_lens, md.qo_indptr, md.page_table, md.page_table_start, 16)
    assert direct.source is None  # built field by field: held to the bounds of page_table only
    direct.check(num_cache_pages=p.kv_cache.shape[0], num_tokens=len(LENS))
