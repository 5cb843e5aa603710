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
    with pytest.raises(MLAInputError, match=r"kv_cache\.dtype=torch\.int8 is not supported; expected float16, "
                                            r"bfloat16, float32, float8_e4m3fn \(sm90\) or float8_e4m3fnuz \(gfx942\)"):
        mla_decode(p.q, p.kv_cache.to(torch.int8), md, SCALE)
    with pytest.raises(MLAInputError, match=r"kv_cache\.dtype=torch\.float8_e5m2 is not supported"):
        mla_decode(p.q, p.kv_cache.to(torch.float8_e5m2), md, SCALE, k_scale=1.0)


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
    with pytest.raises(MLAInputError, match=r"metadata\.page_table=entry 7 \(read by request 2\).*\[0, num_pages=7\)"):
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
                        r"metadata\.kv_lens\[1\]=-1.*non-negative"),
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


# ---------------------------------------------------------------- nothing silent: metadata held to itself
def two_requests_block_table(lens, width=2):
    """Request r's row holds pages [2r, 2r + 1] of a 4-page cache with 16-token pages."""
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width) % 4
    return MLADecodeMetadata.from_block_table(table, torch.tensor(lens, dtype=torch.int32), 16)


def run_small(md, **kw):
    q = torch.randn(md.batch_size * (md.q_len if isinstance(md.q_len, int) else 1), 2, 576).bfloat16()
    kv = torch.randn(4, 16, 576).bfloat16()
    return mla_decode(q, kv, md, SCALE, **kw)


def test_block_table_length_beyond_its_own_row():
    """Row 0 holds 2 pages (32 tokens): seq_lens[0]=40 would read row 1's first page."""
    md = two_requests_block_table([40, 5])
    with pytest.raises(MLAInputError, match=r"metadata\.kv_lens\[0\]=40 \(seq_lens of from_block_table\).*"
                                            r"at most 32 tokens.*block_table row of 2 pages x page_size 16"):
        run_small(md)
    with pytest.raises(MLAInputError, match=r"kv_lens\[0\]=40"):
        md.check()
    run_small(two_requests_block_table([32, 5]))  # exactly its row: fine


def test_csr_length_beyond_its_own_pages():
    """kv_indptr gives request 0 one page; kv_lens[0]=40 would read request 1's pages."""
    md = MLADecodeMetadata.from_csr(torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([3, 0, 1, 2],
                                    dtype=torch.int32), 16, kv_lens=torch.tensor([40, 20], dtype=torch.int32))
    with pytest.raises(MLAInputError, match=r"metadata\.kv_lens\[0\]=40 \(kv_lens of from_csr\).*at most 16 "
                                            r"tokens.*kv_indptr\[1\] - kv_indptr\[0\] = 1 pages"):
        run_small(md)


@pytest.mark.parametrize("indptr,last,bad", [([0, 1, 2], [21, 5], r"kv_last_page_len\[0\]=21"),
                                             ([0, 0, 2], [0, -4], r"kv_last_page_len\[1\]=-4"),
                                             ([0, 1, 2], [0, 5], r"kv_last_page_len\[0\]=0"),
                                             ([0, 0, 2], [17, 5], r"kv_last_page_len\[0\]=17")])
def test_csr_last_page_len_out_of_range(indptr, last, bad):
    """FlashInfer's convention: 1..page_size tokens in the last page (0..page_size for a request with no page)."""
    md = MLADecodeMetadata.from_csr(torch.tensor(indptr, dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
                                    16, kv_last_page_len=torch.tensor(last, dtype=torch.int32))
    with pytest.raises(MLAInputError, match=bad + r".*1\.\.page_size=16"):
        run_small(md)


def test_csr_last_page_len_zero_for_an_empty_request():
    md = MLADecodeMetadata.from_csr(torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32),
                                    16, kv_last_page_len=torch.tensor([0, 16], dtype=torch.int32))
    assert md.kv_lens.tolist() == [0, 32]
    run_small(md)


@pytest.mark.parametrize("indptr", [[0, 3, 1], [1, 2, 3]])
def test_csr_indptr_must_be_non_decreasing_from_zero(indptr):
    md = MLADecodeMetadata.from_csr(torch.tensor(indptr, dtype=torch.int32), torch.tensor([3, 1, 2, 0], dtype=torch.int32),
                                    16, kv_last_page_len=torch.tensor([4, 4], dtype=torch.int32))
    with pytest.raises(MLAInputError, match=r"kv_indptr=\[%s\].*non-decreasing from 0" % ", ".join(map(str, indptr))):
        run_small(md)


def test_q_len_must_match_qo_indptr():
    """q_len=1 with 3 queries over 3 requests, but ragged [2, 0, 1]: the kernels would read the wrong rows."""
    md = MLADecodeMetadata.from_block_table(torch.zeros(3, 1, dtype=torch.int32), torch.tensor([1, 1, 1]), 16, q_len=1,
                                            qo_indptr=torch.tensor([0, 2, 2, 3]))
    with pytest.raises(MLAInputError, match=r"metadata\.qo_indptr=\[0, 2, 2, 3\] \(request 0 has 2 queries\)"):
        mla_decode(torch.randn(3, 2, 576), torch.randn(1, 16, 576), md, SCALE)


@pytest.mark.parametrize("page_size", [0, -16, 3, 24, 16.0, True, "16", None, torch.tensor(16)])
@pytest.mark.parametrize("layout", ["block_table", "csr"])
def test_page_size_positive_power_of_two(page_size, layout):
    with pytest.raises(MLAInputError, match=r"page_size=.*positive power of two"):
        if layout == "block_table":
            MLADecodeMetadata.from_block_table(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 1]), page_size)
        else:
            MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                       page_size, kv_lens=torch.tensor([1]))


@pytest.mark.parametrize("q_len", [0, -1, 1.5, 5, True, "2"])
def test_q_len_host_int_in_range(q_len):
    with pytest.raises(MLAInputError, match=r"q_len=.*expected an int in 1\.\.4"):
        MLADecodeMetadata.from_block_table(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 1]), 16, q_len=q_len)
    with pytest.raises(MLAInputError, match=r"q_len=.*expected an int in 1\.\.4"):
        MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16,
                                   kv_lens=torch.tensor([1]), q_len=q_len)


def test_numpy_ints_are_host_ints():
    np = pytest.importorskip("numpy")
    md = MLADecodeMetadata.from_block_table(torch.zeros(2, 1, dtype=torch.int32), torch.tensor([1, 1]), np.int64(16),
                                            q_len=np.int32(2))
    assert (md.page_size, md.q_len) == (16, 2) and type(md.page_size) is int and type(md.q_len) is int


def test_fields_set_directly_are_checked_too():
    """dataclasses.replace re-runs the host checks, and check_indices re-checks a field overwritten later."""
    md = two_requests_block_table([5, 5])
    with pytest.raises(MLAInputError, match=r"page_size=0 "):
        replace(md, page_size=0)
    with pytest.raises(MLAInputError, match=r"q_len=1\.5 "):
        replace(md, q_len=1.5)
    md.q_len = 1.5  # overwritten after construction: named, not blamed on q
    with pytest.raises(MLAInputError, match=r"metadata\.q_len=1\.5"):
        run_small(md)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool, torch.int16])
def test_non_integer_lengths_are_refused(dtype):
    """Float lengths would be truncated silently; only int32 (in place) and int64 (converted) are taken."""
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(MLAInputError, match=rf"seq_lens must be an int32 tensor \(int64 is converted\), got {dtype}"):
        MLADecodeMetadata.from_block_table(table, torch.tensor([1.7, 2.2]).to(dtype), 16)
    with pytest.raises(MLAInputError, match=rf"qo_indptr must be an int32 tensor.*got {dtype}"):
        MLADecodeMetadata.from_block_table(table, torch.tensor([1, 2]), 16, qo_indptr=torch.tensor([0, 1, 2]).to(dtype))
    indptr, indices = torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(MLAInputError, match=rf"kv_lens must be an int32 tensor.*got {dtype}"):
        MLADecodeMetadata.from_csr(indptr, indices, 16, kv_lens=torch.tensor([3]).to(dtype))
    with pytest.raises(MLAInputError, match=rf"kv_last_page_len must be an int32 tensor.*got {dtype}"):
        MLADecodeMetadata.from_csr(indptr, indices, 16, kv_last_page_len=torch.tensor([3]).to(dtype))
    with pytest.raises(MLAInputError, match=rf"kv_indptr must be an int32 tensor.*got {dtype}"):
        MLADecodeMetadata.from_csr(indptr.to(dtype), indices, 16, kv_lens=torch.tensor([3]))


def test_int64_lengths_are_converted():
    md = MLADecodeMetadata.from_csr(torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1], dtype=torch.int32), 16,
                                    kv_lens=torch.tensor([16, 17]), qo_indptr=torch.tensor([0, 1, 2]), q_len=1)
    for name in ("kv_lens", "qo_indptr", "page_table_start"):
        assert getattr(md, name).dtype == torch.int32, name
    assert md.kv_lens.tolist() == [16, 17] and md.page_table_start.tolist() == [0, 1]


def test_csr_lengths_given_twice():
    with pytest.raises(MLAInputError, match=r"kv_last_page_len and kv_lens were both given"):
        MLADecodeMetadata.from_csr(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 16,
                                   kv_lens=torch.tensor([3]), kv_last_page_len=torch.tensor([3]))


def test_constructor_tensors_on_one_device():
    with pytest.raises(MLAInputError, match=r"seq_lens is on meta, block_table on cpu"):
        MLADecodeMetadata.from_block_table(torch.zeros(2, 1, dtype=torch.int32),
                                           torch.zeros(2, dtype=torch.int32, device="meta"), 16)


@pytest.mark.parametrize("metadata", [None, {"kv_lens": [1]}, "md"])
def test_metadata_of_the_wrong_type(prob, metadata):
    p, _ = prob
    with pytest.raises(MLAInputError, match=r"metadata=a builtins\.\w+ is not supported; expected an MLADecodeMetadata"):
        mla_decode(p.q, p.kv_cache, metadata, SCALE)


def test_fp8_cache_needs_k_scale(prob):
    p, md = prob
    with pytest.raises(MLAInputError, match=r"k_scale=None is not supported; expected the dequantisation scale of "
                                            r"the torch\.float8_e4m3fn kv_cache"):
        mla_decode(p.q, p.kv_cache.to(torch.float8_e4m3fn), md, SCALE)
    mla_decode(p.q, p.kv_cache.to(torch.float8_e4m3fn), md, SCALE, k_scale=1.0)  # a plain cast says so
    with pytest.raises(MLAInputError, match=r"k_scale=None is not supported; expected the dequantisation scale of "
                                            r"the torch\.float8_e4m3fnuz kv_cache"):
        mla_decode(p.q, p.kv_cache.to(torch.float8_e4m3fnuz), md, SCALE)
    mla_decode(p.q, p.kv_cache.to(torch.float8_e4m3fnuz), md, SCALE, k_scale=1.0)


def test_k_scale_tensor_must_be_one_float(prob):
    p, md = prob
    kv = p.kv_cache.to(torch.float8_e4m3fn)
    for bad in (torch.ones(2), torch.ones(1, dtype=torch.int32)):
        with pytest.raises(MLAInputError, match=r"k_scale=a torch\.\w+ tensor of shape"):
            mla_decode(p.q, kv, md, SCALE, k_scale=bad)
    mla_decode(p.q, kv, md, SCALE, k_scale=torch.tensor([0.5]))


def test_vllm_padded_graph_rows_pass():
    """vLLM's full CUDA graphs pad the batch with rows of seq_len 0 whose block-table entries are stale junk."""
    table = torch.tensor([[2, 0], [1, 3], [10**6, -7], [-1, 99]], dtype=torch.int32)
    md = MLADecodeMetadata.from_block_table(table, torch.tensor([20, 17, 0, 0], dtype=torch.int32), 16)
    out = run_small(md)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_index_checks_off_skip_value_checks():
    """check_indices=False (engines' hot path): no value check runs (and no host read of the metadata)."""
    md = two_requests_block_table([5, 5])
    md.check(num_cache_pages=4, num_tokens=2)
    bad = two_requests_block_table([40, 5])
    run_small(bad, check_indices=False)  # the caller's promise; not checked
