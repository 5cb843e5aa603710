"""The reference op (what ``mla_decode`` runs on CPU) against an independent dense fp64 attention."""

from __future__ import annotations

import math

import pytest
import torch

from mla_backend import MLADecodeMetadata, mla_decode, mla_decode_reference
from mla_problems import SCALE, assert_matches, make_problem, naive_attention

# Ragged: empty, one token, a page boundary +-1, not a multiple of any page size.
LENS = [0, 1, 15, 16, 17, 64, 65, 130]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_dense_attention(page_size, heads, dtype):
    p = make_problem(LENS, heads, 1, page_size, dtype, seed=page_size * 1000 + heads)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    assert_matches(out, lse, *naive_attention(p), dtype)


@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_causal_multi_query(s_q, page_size):
    """Query i of s_q sees positions < kv_len - s_q + i + 1 (the new tokens are the last s_q)."""
    lens = [s_q, s_q + 1, 17, 64, 100]
    p = make_problem(lens, 16, s_q, page_size, torch.bfloat16, seed=s_q * 100 + page_size)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    ref_out, ref_lse = naive_attention(p)
    assert_matches(out, lse, ref_out, ref_lse, torch.bfloat16)
    if s_q > 1:  # the rule is real: later queries of a request see strictly more than earlier ones
        assert not torch.allclose(lse[0], lse[s_q - 1])


def test_zero_length_request_gives_zeros_and_neg_inf():
    p = make_problem([0, 5, 0], 16, 2, 16, seed=1)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    for tokens in (slice(0, 2), slice(4, 6)):
        assert torch.equal(out[tokens], torch.zeros_like(out[tokens]))
        assert torch.isneginf(lse[tokens]).all()
    assert torch.isfinite(lse[2:4]).all()
    assert not torch.isnan(out).any()


def test_kv_shorter_than_queries():
    """kv_len=2 with s_q=4: queries 0 and 1 see nothing (zeros, -inf), 2 sees one token, 3 sees two."""
    p = make_problem([2], 16, 4, 16, seed=2)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isneginf(lse[:2]).all()
    # one visible token: softmax weight 1, so out is that token's latent row and lse its score
    token0 = p.kv_cache[p.pages[0][0], 0]
    torch.testing.assert_close(out[2].float(), token0[:512].float().expand(16, 512), rtol=1e-2, atol=1e-2)
    score = (p.q[2].double() @ token0.double()) * SCALE
    torch.testing.assert_close(lse[2].double(), score, rtol=0, atol=1e-4)
    assert_matches(out, lse, *naive_attention(p), torch.bfloat16)


def test_ragged_query_counts():
    """qo_indptr with different query counts per request (q_len None: reference only)."""
    p = make_problem([10, 0, 40, 3], 16, [1, 2, 4, 3], 16, seed=3)
    md = p.metadata()
    assert md.q_len is None
    out, lse = mla_decode(p.q, p.kv_cache, md, SCALE, return_lse=True)
    assert_matches(out, lse, *naive_attention(p), torch.bfloat16)


def test_lse_is_natural_log():
    """One head, two tokens, q . k known: lse = ln(e^a + e^b)."""
    q = torch.zeros(1, 1, 576, dtype=torch.float32)
    q[0, 0, 0] = 1.0
    kv = torch.randn(1, 2, 576)
    kv[0, 0, 0], kv[0, 1, 0] = 1.0, 3.0
    md = MLADecodeMetadata.from_block_table(torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2]), 2)
    _, lse = mla_decode(q, kv, md, 1.0, return_lse=True)
    assert lse.item() == pytest.approx(math.log(math.e + math.e**3), abs=1e-5)


def test_q_pair_equals_concatenated_q():
    p = make_problem(LENS, 16, 2, 16, seed=4)
    md = p.metadata()
    whole = mla_decode(p.q, p.kv_cache, md, SCALE, return_lse=True)
    # separate tensors (as engines hold them), not views of one 576-wide buffer
    pair = mla_decode((p.q[..., :512].clone(), p.q[..., 512:].clone()), p.kv_cache, md, SCALE, return_lse=True)
    assert torch.equal(whole[0], pair[0]) and torch.equal(whole[1], pair[1])


def test_out_buffer_is_written():
    p = make_problem(LENS, 16, 1, 16, seed=5)
    out = torch.full((p.q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16)
    got, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, out=out, return_lse=True)
    assert got is out
    assert not torch.isnan(out).any()  # every row written, zero-length requests included
    assert_matches(out, lse, *naive_attention(p), torch.bfloat16)


def test_reference_function_directly():
    """mla_decode_reference itself (the oracle the GPU tests use) on split q."""
    p = make_problem(LENS, 16, 2, 64, seed=9)
    out, lse = mla_decode_reference(p.q[..., :512], p.q[..., 512:], p.kv_cache, p.metadata(), SCALE)
    assert_matches(out, lse, *naive_attention(p), torch.bfloat16)


def test_fp8_cache_with_scale():
    """An fp8 cache is dequantised with k_scale before the dot products (reference path)."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    p = make_problem([0, 1, 33, 70], 16, 1, 16, kv_dtype=fp8, seed=6)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, k_scale=0.5, return_lse=True)
    assert_matches(out, lse, *naive_attention(p, k_scale=0.5), torch.bfloat16)


def _e4m3_value(byte: int, bias: int) -> float:
    """An e4m3 byte by the format's definition: sign, 4 exponent bits (bias ``bias``), 3 mantissa bits; exponent 0
    holds the subnormals."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    return sign * (2.0 ** (1 - bias) * m / 8 if e == 0 else 2.0 ** (e - bias) * (1 + m / 8))


def test_fp8_e4m3fnuz_format():
    """The gfx942 kernel's fp8 cache, float8_e4m3fnuz (MI300X's fp8): exponent bias 8, 0x80 the only NaN, no -0 and
    no inf, largest 240. torch (the reference) reads every byte as the definition says; every value converts exactly
    to bf16 and fp16 (the kernel converts the cache to q's dtype before its GEMMs); the same byte read as
    float8_e4m3fn (bias 7, Hopper's) is twice the value, which is why the gfx942 kernel takes no e4m3fn cache."""
    raw = torch.arange(256, dtype=torch.uint8)
    fnuz, fn = raw.view(torch.float8_e4m3fnuz), raw.view(torch.float8_e4m3fn)
    for b, (x, y) in enumerate(zip(fnuz.double().tolist(), fn.double().tolist())):
        if b == 0x80:
            assert math.isnan(x) and y == 0.0
        else:
            assert x == _e4m3_value(b, 8), hex(b)
            assert math.isnan(y) if b & 0x7F == 0x7F else y == _e4m3_value(b, 7) == 2 * x, hex(b)
    finite = fnuz.double().isfinite()
    assert finite.sum() == 255 and fnuz.double()[finite].abs().max() == 240
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(fnuz[finite].to(dtype).double(), fnuz[finite].double())


@pytest.mark.parametrize("q_len", [1, 2])
def test_fp8_e4m3fnuz_cache_with_scale(q_len):
    """An e4m3fnuz cache (gfx942) is dequantised with k_scale: the reference against the fp64 oracle, and against the
    order the gfx942 kernel computes in (cache -> bf16, exact; S = (q . k) * softmax_scale * k_scale; O = (P @ v) *
    k_scale / l), which keeps k_scale out of the GEMMs."""
    k_scale = 0.375
    p = make_problem([0, 1, 33, 70], 16, q_len, 16, kv_dtype=torch.float8_e4m3fnuz, seed=12)
    out, lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, k_scale=k_scale, return_lse=True)
    assert_matches(out, lse, *naive_attention(p, k_scale=k_scale), torch.bfloat16)

    flat = p.kv_cache.reshape(-1, 576)
    tok = 0
    for r, kv_len in enumerate(p.lens):
        rows = [p.pages[r][t // p.page_size] * p.page_size + t % p.page_size for t in range(kv_len)]
        kv16 = flat[rows].to(torch.bfloat16).float()  # the kernel's shared-memory tiles
        for i in range(q_len):
            seen = min(kv_len - q_len + i + 1, kv_len)
            if seen > 0:
                s = (p.q[tok + i].float() @ kv16[:seen].T) * (SCALE * k_scale)
                probs = torch.exp(s - s.max(dim=-1, keepdim=True).values)
                o = (probs @ kv16[:seen, :512]) * k_scale / probs.sum(dim=-1, keepdim=True)
                torch.testing.assert_close(out[tok + i].float(), o, rtol=1e-2, atol=1e-3)
        tok += q_len


def test_flashmla_4d_cache_layout():
    p = make_problem([5, 20], 16, 1, 16, seed=7)
    md = p.metadata()
    a = mla_decode(p.q, p.kv_cache, md, SCALE)
    b = mla_decode(p.q, p.kv_cache.unsqueeze(2), md, SCALE)  # [pages, page_size, 1, 576]
    assert torch.equal(a, b)


def test_fresh_inputs_are_not_trivial():
    """Guards the helpers: random, non-zero data, and pages genuinely out of order."""
    p = make_problem(LENS, 16, 1, 16, seed=8)
    assert p.q.abs().min() > 0 or p.q.count_nonzero() > 0.99 * p.q.numel()
    flat = [i for pages in p.pages for i in pages]
    assert flat != sorted(flat)


# ---------------------------------------------------------------- non-finite inputs propagate (FlashMLA / FA3 rule)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_q_reaches_its_row_only(bad):
    """A NaN (inf) in one query row gives NaN in that row's output and LSE, never zeros; other rows are untouched,
    and a zero-length request still gives zeros and -inf."""
    p = make_problem([0, 20, 33], 4, 1, 16, seed=12)
    clean, clean_lse = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    q = p.q.clone()
    q[1, 2, 7] = bad  # request 1, head 2
    q[0, :, 0] = bad  # request 0 sees nothing: still zeros and -inf
    out, lse = mla_decode(q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    assert torch.isnan(out[1, 2]).all()
    assert torch.isnan(lse[1, 2]) or torch.isposinf(lse[1, 2])  # inf: +inf scores give LSE +inf (NaN for NaN)
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(out[keep], clean[keep]) and torch.equal(lse[keep], clean_lse[keep])
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


def test_nan_in_a_visible_cache_row_reaches_the_request():
    p = make_problem([20, 33], 4, 2, 16, seed=13)
    kv = p.kv_cache.clone()
    page, slot = p.pages[1][33 // 16], 33 % 16 - 1  # request 1's last token (seen by its second query only)
    kv[page, slot, 3] = float("nan")
    out, lse = mla_decode(p.q, kv, p.metadata(), SCALE, return_lse=True)
    assert torch.isnan(out[3]).all() and torch.isnan(lse[3]).all()  # request 1, query 1
    assert not torch.isnan(out[:3]).any() and not torch.isnan(lse[:3]).any()  # query 0 does not see that token


@pytest.mark.parametrize("where", ["v", "k_pe"])
def test_nan_past_a_request_is_never_read(where):
    """Slots past kv_len in the last page (stale or never written: could be NaN) do not touch the output."""
    p = make_problem([20, 33], 4, 1, 16, seed=14)
    clean = mla_decode(p.q, p.kv_cache, p.metadata(), SCALE, return_lse=True)
    kv = p.kv_cache.clone()
    cols = slice(0, 512) if where == "v" else slice(512, 576)
    kv[p.pages[0][1], 20 - 16:, cols] = float("nan")
    kv[p.pages[1][2], 33 - 32:, cols] = float("nan")
    spare = sorted(set(range(kv.shape[0])) - {i for pages in p.pages for i in pages})
    kv[spare] = float("nan")  # pages no request owns
    got = mla_decode(p.q, kv, p.metadata(), SCALE, return_lse=True)
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1], clean[1])


def test_nan_in_a_causally_hidden_value_is_not_read():
    """MTP: query 0 of 3 does not see the last two tokens, so NaN in their values (c_kv) must not reach it."""
    p = make_problem([19], 4, 3, 16, seed=15)
    kv = p.kv_cache.clone()
    kv[p.pages[0][1], 2, :512] = float("nan")  # token 18, seen by query 2 only
    out, lse = mla_decode(p.q, kv, p.metadata(), SCALE, return_lse=True)
    assert not torch.isnan(out[:2]).any() and not torch.isnan(lse[:2]).any()
    assert torch.isnan(out[2]).all()
    assert_matches(out[:2], lse[:2], *(x[:2] for x in naive_attention(p)), torch.bfloat16)
