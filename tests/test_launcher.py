"""``MLADecodeLauncher`` on CPU: its reference path agrees with ``mla_decode``, and its build refuses bad arguments
naming the argument, the value and what is supported."""

from __future__ import annotations

import logging

import pytest
import torch

from mla_backend import MLADecodeLauncher, MLADecodeMetadata, MLAInputError, SplitPlanner, mla_decode
from mla_problems import SCALE, make_problem, naive_attention


def launcher(heads=16, page_size=16, dtype=torch.bfloat16, **kwargs):
    return MLADecodeLauncher("cpu", heads, page_size=page_size, dtype=dtype, softmax_scale=SCALE, **kwargs)


def planned(p, heads, q_len=None):
    """The problem's metadata with a plan, as an engine makes it once per step."""
    md = p.metadata()
    md.plan = SplitPlanner(max(md.batch_size, 1), heads, md.q_len or 1, "cpu", num_sms=8).plan(md.kv_lens)
    return md


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("q_len,page_size,heads", [(1, 16, 16), (2, 64, 8), (4, 1, 4), (3, 32, 128)])
def test_reference_path_agrees_with_mla_decode(seed, q_len, page_size, heads):
    g = torch.Generator().manual_seed(seed)
    lens = [max(q_len, int(n)) for n in torch.randint(0, 300, (int(torch.randint(1, 6, (1,), generator=g)),),
                                                      generator=g)]
    lens[0] = q_len - 1 if q_len > 1 else 0  # a request that sees nothing (zeros, LSE -inf)
    p = make_problem(lens, heads, q_len, page_size, seed=seed)
    md = planned(p, heads)
    launch = launcher(heads, page_size, q_lens=(q_len,))
    q_nope, q_pe = p.q[..., :512], p.q[..., 512:]
    out = torch.full((p.q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16)
    got, lse = launch(q_nope, q_pe, p.kv_cache, md, out, return_lse=True)
    want, want_lse = mla_decode(p.q, p.kv_cache, md, SCALE, return_lse=True)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.equal(launch(q_nope, q_pe, p.kv_cache, md), want)  # a new output, LSE not returned
    ref, _ = naive_attention(p)
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-3)


def test_ragged_batch_and_unlisted_q_len():
    # q_len None (ragged) and a q_len the launcher was not built with: prepared at their first call
    p = make_problem([7, 40, 3], 16, [1, 3, 2], 16, seed=3)
    md = p.metadata()
    assert md.q_len is None
    launch = launcher(q_lens=(1,))
    got = launch(p.q[..., :512], p.q[..., 512:], p.kv_cache, md)
    assert torch.equal(got, mla_decode(p.q, p.kv_cache, md, SCALE))
    p2 = make_problem([9, 20], 16, 2, 16, seed=4)
    md2 = planned(p2, 16)
    assert torch.equal(launch(p2.q[..., :512], p2.q[..., 512:], p2.kv_cache, md2),
                       mla_decode(p2.q, p2.kv_cache, md2, SCALE))
    assert launch.variant(2).is_reference and launch.variant(None).is_reference


def test_fp8_cache_with_tensor_and_float_scales():
    p = make_problem([30, 65, 1], 16, 1, 16, seed=5)
    cache = (p.kv_cache.float() / 0.5).to(torch.float8_e4m3fn)
    md = planned(p, 16)
    want = mla_decode(p.q, cache, md, SCALE, k_scale=0.5)
    scale = torch.tensor(0.5)  # vLLM's layer._k_scale: a 0-d fp32 tensor
    by_tensor = launcher(kv_dtype=torch.float8_e4m3fn, k_scale=scale)
    by_float = launcher(kv_dtype=torch.float8_e4m3fn, k_scale=0.5)
    for launch in (by_tensor, by_float):
        assert torch.equal(launch(p.q[..., :512], p.q[..., 512:], cache, md), want)
    scale.fill_(0.25)  # refilled in place (a checkpoint's scale loaded later): the launcher reads the new value
    assert torch.equal(by_tensor(p.q[..., :512], p.q[..., 512:], cache, md),
                       mla_decode(p.q, cache, md, SCALE, k_scale=0.25))


def test_fp8_compute_off_gpu_runs_the_reference():
    """fp8_compute lets the sm90 kernel quantise q; without one (here: a CPU) the reference keeps q exact, so the
    answer is mla_decode's without it, and a bf16 cache refuses it in mla_decode as in the launcher."""
    p = make_problem([30, 65, 1], 32, 2, 16, seed=6)
    cache = (p.kv_cache.float() / 0.5).to(torch.float8_e4m3fn)
    md = planned(p, 32, 2)
    launch = launcher(heads=32, kv_dtype=torch.float8_e4m3fn, k_scale=0.5, q_lens=(2,), fp8_compute=True)
    assert launch.variant(2).is_reference and "fp8compute" not in repr(launch)
    want = mla_decode(p.q, cache, md, SCALE, k_scale=0.5)
    assert torch.equal(launch(p.q[..., :512], p.q[..., 512:], cache, md), want)
    assert torch.equal(mla_decode(p.q, cache, md, SCALE, k_scale=0.5, fp8_compute=True), want)
    with pytest.raises(MLAInputError, match=r"mla_decode: fp8_compute=True is not supported; expected with an fp8 "
                                            r"kv_cache"):
        mla_decode(p.q, p.kv_cache, md, SCALE, fp8_compute=True)


def test_zero_tokens():
    md = MLADecodeMetadata.from_block_table(torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                            16, q_len=1)
    empty = torch.zeros(0, 16, 512, dtype=torch.bfloat16)
    out, lse = launcher()(empty, torch.zeros(0, 16, 64, dtype=torch.bfloat16),
                          torch.zeros(1, 16, 576, dtype=torch.bfloat16), md, return_lse=True)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)


def test_logs_its_choice_like_mla_decode(caplog):
    with caplog.at_level(logging.INFO, logger="mla_backend"):
        launcher(heads=12, page_size=32, q_lens=(1, 2))
    lines = [r.getMessage() for r in caplog.records if "using reference" in r.getMessage()]
    assert any("12, 1, 32)" in line and "no GPU kernel for device type 'cpu'" in line for line in lines), lines
    assert any("12, 2, 32)" in line for line in lines), lines


def test_changing_batch_sizes():
    # the LSE scratch grows (2 rows, then 4) and is reused (1)
    launch = launcher()
    outs = []
    for lens in ([5, 9], [5, 9, 30, 2], [7]):
        p = make_problem(lens, 16, 1, 16, seed=len(lens))
        md = planned(p, 16)
        outs.append(launch(p.q[..., :512], p.q[..., 512:], p.kv_cache, md))
        assert torch.equal(outs[-1], mla_decode(p.q, p.kv_cache, md, SCALE))


# ---------------------------------------------------------------- build-time refusals
@pytest.mark.parametrize("kwargs,match", [
    (dict(heads=0), r"MLADecodeLauncher: num_heads=0 is not supported; expected an int >= 1"),
    (dict(heads=True), r"num_heads=True is not supported"),
    (dict(page_size=48), r"MLADecodeLauncher: page_size=48 is not supported; expected a positive power of two"),
    (dict(q_lens=(1, 5)), r"MLADecodeLauncher: q_lens=5 is not supported; expected an int in 1\.\.4"),
    (dict(q_lens=()), r"q_lens=\(\) is not supported; expected a non-empty sequence"),
    (dict(q_lens=2), r"q_lens=2 is not supported; expected a non-empty sequence"),
    (dict(dtype=torch.int8), r"MLADecodeLauncher: dtype=torch\.int8 is not supported; expected torch\.float16"),
    (dict(kv_dtype=torch.float16), r"kv_dtype=torch\.float16 is not supported; expected the query dtype "
                                   r"\(torch\.bfloat16\), torch\.float8_e4m3fn \(sm90\) or torch\.float8_e4m3fnuz "
                                   r"\(gfx942\)"),
    (dict(softmax_scale=-1.0), r"MLADecodeLauncher: softmax_scale=-1\.0 is not supported; expected a finite positive"),
    (dict(softmax_scale=float("nan")), r"softmax_scale=nan is not supported"),
    (dict(k_scale=0.5), r"MLADecodeLauncher: k_scale=0\.5 is only meaningful for an fp8 kv_cache, got torch\.bfloat16"),
    (dict(kv_dtype=torch.float8_e4m3fn, k_scale=torch.ones(2)),
     r"k_scale=a torch\.float32 tensor of shape \(2,\) on cpu is not supported; expected one float"),
    (dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.0), r"k_scale=0\.0 is not supported; expected a finite positive"),
    (dict(impl="cuda-magic"), r"MLADecodeLauncher: impl='cuda-magic' is not supported; expected one of"),
    (dict(fp8_compute=True), r"MLADecodeLauncher: fp8_compute=True is not supported; expected with an fp8 kv_cache "
                             r"\(float8_e4m3fn on sm90\); this cache is torch\.bfloat16"),
    (dict(kv_dtype=torch.float8_e4m3fn, k_scale=1.0, fp8_compute=1),
     r"MLADecodeLauncher: fp8_compute=1 is not supported; expected True or False"),
    (dict(impl="tilelang-sm90"), r"MLADecodeLauncher: impl='tilelang-sm90' cannot run here: no GPU kernel for "
                                 r"device type 'cpu'"),
])
def test_build_refuses(kwargs, match):
    args = dict(heads=16, page_size=16, dtype=torch.bfloat16, softmax_scale=SCALE)
    args.update(kwargs)
    heads, page_size, dtype = args.pop("heads"), args.pop("page_size"), args.pop("dtype")
    with pytest.raises(MLAInputError, match=match):
        MLADecodeLauncher("cpu", heads, page_size=page_size, dtype=dtype, **args)


def test_fp8_without_k_scale_refused_at_build():
    with pytest.raises(MLAInputError, match=r"MLADecodeLauncher: k_scale=None is not supported; expected the "
                                            r"dequantisation scale of the torch\.float8_e4m3fn kv_cache"):
        launcher(kv_dtype=torch.float8_e4m3fn)


def test_call_without_plan_says_so(monkeypatch):
    # On a kernel variant (forced here with a stand-in: no GPU), a metadata without a plan names the fix.
    from mla_backend import launcher as launcher_module

    launch = launcher()
    stub = launcher_module.KernelVariant.__new__(launcher_module.KernelVariant)
    stub._cu = (None, -1, None)
    launch._variants[1] = stub
    p = make_problem([5], 16, 1, 16)
    with pytest.raises(MLAInputError, match=r"metadata\.plan is None; plan the step with a SplitPlanner"):
        launch(p.q[..., :512], p.q[..., 512:], p.kv_cache, p.metadata())
