"""Every input check of ``mla_decode`` raises an error naming the argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backend import MLADecodeMetadata, MLAInputError, mla_decode
from mla_problems import SCALE, make_problem


@pytest.fixture
def prob():
    """3 requests of 16 heads, page size 16, lengths 5/0/40: q [3, 16, 576], 4 + 3 pages."""
    p = make_problem([5, 0, 40], 16, 1, 16, seed=11)
    return p, p.metadata()


def replace(md, **fields):
    return dataclasses.replace(md, **fields)


def test_valid_inputs_pass(prob):
    p, md = prob
    assert mla_decode(p.q, p.kv_cache, md, SCALE).shape == (3, 16, 512)


def test_integer_q(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q\.dtype=torch\.int32"):
        mla_decode(p.q.int(), p.kv_cache, md, SCALE)


@pytest.mark.parametrize("width", [512, 575, 640])
def test_head_dim(prob, width):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q\.shape=\(3, 16, %d\).*576" % width):
        mla_decode(torch.randn(3, 16, width).bfloat16(), p.kv_cache, md, SCALE)


def test_q_nope_width(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q_nope\.shape"):
        mla_decode((p.q[..., :576], p.q[..., 512:]), p.kv_cache, md, SCALE)


@pytest.mark.parametrize("pe_shape", [(3, 16, 32), (3, 8, 64), (2, 16, 64)])
def test_q_pe_shape(prob, pe_shape):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q_pe\.shape"):
        mla_decode((p.q[..., :512], torch.randn(pe_shape).bfloat16()), p.kv_cache, md, SCALE)


def test_q_pe_dtype(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q_pe\.dtype"):
        mla_decode((p.q[..., :512], p.q[..., 512:].half()), p.kv_cache, md, SCALE)


def test_q_pair_of_three(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"q=a sequence of 3 tensors"):
        mla_decode((p.q, p.q, p.q), p.kv_cache, md, SCALE)


def test_kv_cache_last_dim(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"kv_cache\.shape=\(7, 16, 512\)"):
        mla_decode(p.q, p.kv_cache[..., :512], md, SCALE)


def test_kv_dtype_mismatch(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"kv_cache\.dtype=torch\.float16.*query dtype"):
        mla_decode(p.q, p.kv_cache.half(), md, SCALE)


def test_kv_dtype_unsupported(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"kv_cache\.dtype=torch\.int8"):
        mla_decode(p.q, p.kv_cache.to(torch.int8), md, SCALE)


def test_k_scale_without_fp8(prob):
    p, md = prob
    with pytest.raises(ValueError, match=r"k_scale=0\.5 is only meaningful for an fp8 kv_cache"):
        mla_decode(p.q, p.kv_cache, md, SCALE, k_scale=0.5)


def test_page_size_mismatch(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"metadata\.page_size=64.*kv_cache\.shape\[1\] \(16\)"):
        mla_decode(p.q, p.kv_cache, replace(md, page_size=64), SCALE)


def test_page_id_out_of_range(prob):
    p, md = prob
    table = p.block_table()
    table[2, 1] = p.kv_cache.shape[0]  # one past the last page
    bad = MLADecodeMetadata.from_block_table(table, md.kv_lens, 16)
    with pytest.raises(MLAInputError, match=r"metadata\.page_table=entry 7.*\[0, num_pages=7\)"):
        mla_decode(p.q, p.kv_cache, bad, SCALE)


def test_negative_page_id(prob):
    p, md = prob
    table = p.block_table()
    table[0, 0] = -1
    bad = MLADecodeMetadata.from_block_table(table, md.kv_lens, 16)
    with pytest.raises(MLAInputError, match=r"metadata\.page_table=entry -1"):
        mla_decode(p.q, p.kv_cache, bad, SCALE)


def test_page_table_start_past_the_table(prob):
    p, md = prob
    start = md.page_table_start.clone()
    start[2] = md.page_table.shape[0] - 1  # request 2 needs 3 pages from here
    with pytest.raises(MLAInputError, match=r"metadata\.page_table_start=a request whose pages run past page_table"):
        mla_decode(p.q, p.kv_cache, replace(md, page_table_start=start), SCALE)


def test_index_checks_can_be_skipped(prob):
    """check_indices=False (engines' hot path) does not read the metadata on the host."""
    p, md = prob
    mla_decode(p.q, p.kv_cache, md, SCALE, check_indices=False)


# A metadata field replaced by a bad value (from the valid metadata), and the error that names it.
BAD_METADATA = {
    "negative_kv_len": (lambda md: dict(kv_lens=torch.tensor([5, -1, 40], dtype=torch.int32)),
                        r"metadata\.kv_lens=min -1"),
    "qo_indptr_shape": (lambda md: dict(qo_indptr=md.qo_indptr[:3]),
                        r"metadata\.qo_indptr\.shape=\(3,\).*\[batch \+ 1\] = \[4\]"),
    "qo_indptr_values": (lambda md: dict(qo_indptr=torch.tensor([0, 2, 1, 3], dtype=torch.int32), q_len=None),
                         r"metadata\.qo_indptr=.*non-decreasing"),
    "page_table_start_shape": (lambda md: dict(page_table_start=md.page_table_start[:2]),
                               r"metadata\.page_table_start\.shape"),
    "token_count_vs_q_len": (lambda md: dict(q_len=2), r"q\.shape\[0\]=3.*batch \* q_len = 3 \* 2"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_metadata(prob, case):
    p, md = prob
    fields, match = BAD_METADATA[case]
    with pytest.raises(MLAInputError, match=match):
        mla_decode(p.q, p.kv_cache, replace(md, **fields(md)), SCALE)


@pytest.mark.parametrize("name", ["kv_lens", "qo_indptr", "page_table", "page_table_start"])
def test_int64_metadata(prob, name):
    p, md = prob
    with pytest.raises(MLAInputError, match=rf"metadata\.{name}\.dtype=torch\.int64.*int32"):
        mla_decode(p.q, p.kv_cache, replace(md, **{name: getattr(md, name).long()}), SCALE)


@pytest.mark.parametrize("shape,dtype", [((3, 16, 576), torch.bfloat16), ((3, 8, 512), torch.bfloat16),
                                         ((3, 16, 512), torch.float16)])
def test_out_buffer(prob, shape, dtype):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"mla_decode: out=.*expected \(3, 16, 512\) torch\.bfloat16"):
        mla_decode(p.q, p.kv_cache, md, SCALE, out=torch.empty(shape, dtype=dtype))


def test_unknown_impl(prob):
    p, md = prob
    with pytest.raises(ValueError, match=r"impl='cuda-magic' is not supported"):
        mla_decode(p.q, p.kv_cache, md, SCALE, impl="cuda-magic")


@pytest.mark.parametrize("impl", ["tilelang-sm90", "tilelang-gfx942"])
def test_kernel_impl_on_cpu(prob, impl):
    p, md = prob
    with pytest.raises(ValueError, match=rf"impl='{impl}' cannot run here: no GPU kernel for device type 'cpu'"):
        mla_decode(p.q, p.kv_cache, md, SCALE, impl=impl)


def test_reference_impl_forced(prob):
    p, md = prob
    assert torch.equal(mla_decode(p.q, p.kv_cache, md, SCALE, impl="reference"), mla_decode(p.q, p.kv_cache, md, SCALE))


def test_reference_refused_under_graph_capture(prob, monkeypatch):
    # On a GPU without a kernel (or impl="reference"), capturing a CUDA graph must fail with our message, not
    # with torch's host-copy error from inside the reference. Simulated: capture needs a GPU.
    from mla_backend import op

    monkeypatch.setattr(op, "_capturing", lambda device: True)
    p, md = prob
    with pytest.raises(MLAInputError, match=r"reference path \(requested\) cannot run inside CUDA-graph capture"):
        mla_decode(p.q, p.kv_cache, md, SCALE, impl="reference")


@pytest.mark.gpu
def test_mismatched_devices(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"devices=q on cuda.*kv_cache on cpu"):
        mla_decode(p.q.cuda(), p.kv_cache, md.to("cuda"), SCALE)


# ---------------------------------------------------------------- metadata constructors
def test_block_table_must_be_int32():
    with pytest.raises(ValueError, match=r"block_table must be int32"):
        MLADecodeMetadata.from_block_table(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 2]), 16)


def test_block_table_must_be_2d():
    with pytest.raises(ValueError, match=r"block_table must be 2-D"):
        MLADecodeMetadata.from_block_table(torch.zeros(6, dtype=torch.int32), torch.tensor([1, 2]), 16)


def test_seq_lens_must_match_batch():
    with pytest.raises(ValueError, match=r"seq_lens must be \[batch=2\]"):
        MLADecodeMetadata.from_block_table(torch.zeros(2, 3, dtype=torch.int32), torch.tensor([1, 2, 3]), 16)


def test_csr_needs_lengths():
    with pytest.raises(ValueError, match=r"kv_last_page_len or kv_lens must be given"):
        MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16)


def test_csr_indices_must_be_int32():
    with pytest.raises(ValueError, match=r"kv_indices must be int32"):
        MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 16,
                                   kv_lens=torch.tensor([3]))


def test_csr_last_page_len_shape():
    with pytest.raises(ValueError, match=r"kv_last_page_len must be \[batch=1\]"):
        MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16,
                                   kv_last_page_len=torch.tensor([3, 4]))


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf"), None, "0.1", True])
def test_softmax_scale_must_be_positive(prob, scale):
    """The Hopper kernel takes S's row max on the raw scores and scales it after (exact only for a positive scale):
    anything else is refused by name, on every path (here the CPU reference)."""
    p, md = prob
    with pytest.raises(MLAInputError, match=r"softmax_scale=.*finite positive float"):
        mla_decode(p.q, p.kv_cache, md, scale)


@pytest.mark.parametrize("k_scale", [0.0, -2.0, float("nan")])
def test_host_k_scale_must_be_positive(prob, k_scale):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"k_scale=.*finite positive float or an fp32 device tensor"):
        mla_decode(p.q, p.kv_cache.to(torch.float8_e4m3fn), md, SCALE, k_scale=k_scale)


def test_scale_types_engines_pass(prob):
    """numpy / torch scalars and ints are numbers too (an engine's scale may be any of them)."""
    np = pytest.importorskip("numpy")
    p, md = prob
    ref = mla_decode(p.q, p.kv_cache, md, SCALE)
    for scale in (np.float32(SCALE), np.float64(SCALE), torch.tensor(SCALE, dtype=torch.float64)):
        assert torch.equal(mla_decode(p.q, p.kv_cache, md, scale), ref)
