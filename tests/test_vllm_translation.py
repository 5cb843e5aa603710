"""vLLM's decode batch -> canonical metadata (``vllm_plugin.translate``, no vLLM import): the builder hands out one
metadata object per storage, shape and query length, and never one over another table's pages."""

import pytest
import torch

from mla_backend.metadata import MLADecodeMetadata
from mla_backend.vllm_plugin import translate
from mla_backend.vllm_plugin.translate import DecodeMetadataBuilder


def _check_against_core(md, table, seq, q_len, page_size):
    """``md`` holds ``table``'s rows (at ``page_table_start``), ``seq`` and ``q_len``, as the core's constructor does."""
    want = MLADecodeMetadata.from_block_table(table, seq, page_size=page_size, q_len=q_len)
    assert torch.equal(md.kv_lens, want.kv_lens) and torch.equal(md.qo_indptr, want.qo_indptr)
    for row, start in enumerate(md.page_table_start.tolist()):  # a flat view of the rows' storage
        assert torch.equal(md.page_table[start:start + table.shape[1]], table[row]), row
    assert (md.page_size, md.q_len, md.batch_size) == (page_size, q_len, table.shape[0])


def test_new_views_of_the_same_storage_reuse_the_metadata_with_new_contents():
    gen = torch.Generator().manual_seed(11)
    builder = DecodeMetadataBuilder(8, 16, 16, (1,), "cpu")
    table = torch.randint(1, 50, (8, 20), generator=gen, dtype=torch.int32)
    seq = torch.randint(1, 300, (8,), generator=gen, dtype=torch.int32)
    qsl = torch.arange(9, dtype=torch.int32)
    first = builder.build(table[:6], seq[:6], qsl[:7], 6, int(seq[:6].max()))
    seq[:6] = torch.randint(1, 300, (6,), generator=gen, dtype=torch.int32)  # the next step, refilled in place
    table[:6] = torch.randint(1, 50, (6, 20), generator=gen, dtype=torch.int32)
    again = builder.build(table[:6], seq[:6], qsl[:7], 6, int(seq[:6].max()))
    assert again is first and again.max_kv_len == int(seq[:6].max())
    _check_against_core(again, table[:6], seq[:6], 1, 16)
    block_n = builder.planner(1).block_n
    blocks = (seq[:6] + block_n - 1) // block_n
    assert torch.equal(again.plan.cu_blocks[1:7], torch.cumsum(blocks, 0).to(torch.int32))  # planned again
    smaller = builder.build(table[:5], seq[:5], qsl[:6], 5)
    assert smaller is not first
    _check_against_core(smaller, table[:5], seq[:5], 1, 16)


def test_other_storage_stride_or_query_length_gets_its_own_metadata():
    gen = torch.Generator().manual_seed(12)
    builder = DecodeMetadataBuilder(8, 16, 16, (1, 2), "cpu")
    seq = torch.randint(1, 300, (4,), generator=gen, dtype=torch.int32)
    wide = torch.randint(1, 50, (8, 40), generator=gen, dtype=torch.int32)
    by_40 = wide[:4, :20]  # rows 40 apart
    by_20 = wide.view(16, 20)[:4]  # the same first address, rows 20 apart
    assert by_40.data_ptr() == by_20.data_ptr()
    other = by_40.clone()  # same shape and stride, other storage
    seen = []
    for table, q_len in ((by_40, 1), (by_20, 1), (other, 1), (by_40, 2)):
        qsl = torch.arange(5, dtype=torch.int32) * q_len
        md = builder.build(table, seq, qsl, 4 * q_len)
        assert all(md is not m for m in seen)
        seen.append(md)
        _check_against_core(md, table, seq, q_len, 16)
    assert builder.build(by_40, seq, torch.arange(5, dtype=torch.int32), 4) is seen[0]


def test_the_cache_stays_bounded_when_storage_moves(monkeypatch):
    monkeypatch.setattr(translate, "MAX_BUILT", 2)
    builder = DecodeMetadataBuilder(4, 16, 16, (1,), "cpu")
    seq = torch.tensor([3, 40, 17], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    for step in range(5):
        table = torch.full((3, 4), step + 1, dtype=torch.int32)  # fresh storage every step
        md = builder.build(table, seq, qsl, 3)
        assert md.page_table.data_ptr() == table.data_ptr() and int(md.page_table[0]) == step + 1
        assert len(builder._built) <= 2


@pytest.mark.parametrize("starts, tokens, q_len", [([0, 1], 1, 1), ([0, 2, 4, 4], 6, 2), (list(range(257)), 256, 1),
                                                   ([0, 3, 6, 9, 9, 9], 15, 3)])
def test_uniform_query_len_on_host_lists(starts, tokens, q_len):
    assert translate.uniform_query_len(torch.tensor(starts, dtype=torch.int32), tokens) == q_len


@pytest.mark.parametrize("starts, tokens, match", [([0, 1, 3], 3, "not uniform"), ([0, 2, 1], 2, "not uniform"),
                                                   ([0, 0, 0], 0, "not uniform"), ([0], 0, "empty decode batch"),
                                                   ([0, 2, 4], 5, "num_decode_tokens")])
def test_uniform_query_len_refuses(starts, tokens, match):
    with pytest.raises(ValueError, match=match):
        translate.uniform_query_len(torch.tensor(starts, dtype=torch.int32), tokens)


def test_metadata_storage_is_persistent_across_steps():
    """What a FULL CUDA graph needs: each step's metadata lives at the addresses the capture saw."""
    gen = torch.Generator().manual_seed(3)
    builder = DecodeMetadataBuilder(8, 16, 16, (1, 2), "cpu")
    table = torch.zeros(8, 20, dtype=torch.int32)
    seq = torch.zeros(8, dtype=torch.int32)
    qsl = torch.arange(9, dtype=torch.int32) * 2
    ptrs = None
    for step in range(3):
        seq[:6] = torch.randint(2, 300, (6,), generator=gen, dtype=torch.int32)
        table[:6] = torch.randint(1, 100, (6, 20), generator=gen, dtype=torch.int32)
        md = builder.build(table[:6], seq[:6], qsl[:7], 12)
        now = [md.kv_lens.data_ptr(), md.qo_indptr.data_ptr(), md.page_table.data_ptr(),
               md.page_table_start.data_ptr(), md.plan.cu_blocks.data_ptr(), md.plan.part_begin_req.data_ptr(),
               md.plan.part_end_req.data_ptr(), md.plan.part_start.data_ptr(), md.plan.req_parts.data_ptr(), md.plan.out_partial.data_ptr()]
        assert ptrs is None or now == ptrs, step
        ptrs = now
        block_n = builder.planner(2).block_n
        blocks = (seq[:6] + block_n - 1) // block_n
        assert torch.equal(md.plan.cu_blocks[1:7], torch.cumsum(blocks, 0).to(torch.int32))
    assert md.kv_lens.data_ptr() == seq.data_ptr() and md.page_table.data_ptr() == table.data_ptr()


def test_builder_refuses_bad_batches():
    builder = DecodeMetadataBuilder(4, 16, 16, (1,), "cpu")
    table = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_num_seqs"):
        builder.build(table[:5], torch.ones(5, dtype=torch.int32), torch.arange(6, dtype=torch.int32), 5)
    with pytest.raises(ValueError, match="1..4"):
        builder.build(table[:2], torch.full((2,), 9, dtype=torch.int32), torch.tensor([0, 5, 10], dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="int32"):
        builder.build(table[:2].long(), torch.ones(2, dtype=torch.int32), torch.arange(3, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        builder.build(table[:2], torch.ones(2, dtype=torch.int64), torch.arange(3, dtype=torch.int32), 2)
