"""``MLADecodeLauncher`` on the kernel path: the same bits as ``mla_decode``, the fp32 reference's values, eagerly and
in CUDA-graph replays (marked gpu: skipped without one)."""

from __future__ import annotations

import pytest
import torch

from mla_backend import (MLADecodeLauncher, MLADecodeMetadata, MLAInputError, SplitPlanner, mla_decode,
                         mla_decode_reference)
from mla_backend.dispatch import select_impl

pytestmark = [pytest.mark.gpu, pytest.mark.mla_kernels]  # kernels: tests/precompile.py

SCALE = 192**-0.5
K_SCALE = 0.37
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
PAGE = 64


def _kernel_or_skip(heads, q_len, kv_dtype):
    choice = select_impl(torch.device("cuda"), BF16, kv_dtype, heads, q_len, PAGE)
    if choice.impl == "reference":
        pytest.skip(f"no kernel here: {choice.reason}")


def _cache(num_pages, fp8, g):
    kv = torch.randn(num_pages, PAGE, 576, generator=g)
    return ((kv / K_SCALE).to(FP8) if fp8 else kv.to(BF16)).cuda()


def _query(tokens, heads, g):
    """q as vLLM hands it over: ql_nope the transpose of a [H, T, 512] product, q_pe a slice of a [T, H, 192] one."""
    q_nope = torch.randn(heads, tokens, 512, generator=g).to(BF16).cuda().transpose(0, 1)
    q_pe = torch.randn(tokens, heads, 192, generator=g).to(BF16).cuda()[..., 128:]
    return q_nope, q_pe


def _reference(q_nope, q_pe, cache, md, fp8):
    return mla_decode_reference(q_nope.cpu(), q_pe.cpu(), cache.cpu(), md.to("cpu"), SCALE, K_SCALE if fp8 else 1.0)


def _close(out, lse, ref, ref_lse):
    err = (out.float().cpu() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)
    assert err < 1e-2, f"relative error {err:.3e}"
    lse = lse.cpu()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "LSE -inf pattern differs"
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,lens", [(16, [1, 2, 63, 64, 65, 700, 4100]), (128, [2, 300, 2049]),
                                        (32, [5] * 40 + [3000] * 8)])
def test_launcher_equals_mla_decode_and_reference(fp8, q_len, heads, lens):
    kv_dtype = FP8 if fp8 else BF16
    _kernel_or_skip(heads, q_len, kv_dtype)
    g = torch.Generator().manual_seed(heads + q_len + len(lens))
    lens = [max(n, q_len) for n in lens]
    pages = [-(-n // PAGE) for n in lens]
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages, generator=g).int()
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages):
        table[r, :n] = perm[used:used + n]
        used += n
    cache = _cache(num_pages, fp8, g)
    md = MLADecodeMetadata.from_block_table(table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(), PAGE,
                                            q_len=q_len)
    md.plan = SplitPlanner(len(lens), heads, q_len, "cuda").plan(md.kv_lens)
    q_nope, q_pe = _query(len(lens) * q_len, heads, g)
    k_scale = torch.tensor(K_SCALE, device="cuda") if fp8 else None  # vLLM's layer._k_scale: a 0-d fp32 tensor
    launch = MLADecodeLauncher("cuda", heads, page_size=PAGE, dtype=BF16, kv_dtype=kv_dtype, softmax_scale=SCALE,
                               k_scale=k_scale, q_lens=(q_len,))
    assert not launch.variant(q_len).is_reference
    out = torch.full((len(lens) * q_len, heads, 512), float("nan"), dtype=BF16, device="cuda")
    got, lse = launch(q_nope, q_pe, cache, md, out, return_lse=True)
    want, want_lse = mla_decode((q_nope, q_pe), cache, md, SCALE, k_scale=K_SCALE if fp8 else None, return_lse=True)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    again = launch(q_nope, q_pe, cache, md)  # a new output, the LSE in the launcher's scratch
    assert again.data_ptr() != out.data_ptr() and torch.equal(again, want)
    _close(got, lse, *_reference(q_nope, q_pe, cache, md, fp8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads,batch,max_pages", [(16, 8, 40), (128, 24, 12)])
def test_launcher_in_cuda_graph_replays(fp8, q_len, heads, batch, max_pages):
    """Captured once (after one eager call), replayed with new lengths planned outside the graph."""
    kv_dtype = FP8 if fp8 else BF16
    _kernel_or_skip(heads, q_len, kv_dtype)
    g = torch.Generator().manual_seed(7)
    num_pages = batch * max_pages + 16
    cache = _cache(num_pages, fp8, g)
    table = torch.randperm(num_pages, generator=g)[: batch * max_pages].int().view(batch, max_pages).cuda()
    kv_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    q_nope, q_pe = _query(batch * q_len, heads, g)
    md = MLADecodeMetadata.from_block_table(table, kv_lens, PAGE, q_len=q_len)
    planner = SplitPlanner(batch, heads, q_len, "cuda")
    k_scale = torch.tensor(K_SCALE, device="cuda") if fp8 else None
    launch = MLADecodeLauncher("cuda", heads, page_size=PAGE, dtype=BF16, kv_dtype=kv_dtype, softmax_scale=SCALE,
                               k_scale=k_scale, q_lens=(q_len,))
    out = torch.empty(batch * q_len, heads, 512, dtype=BF16, device="cuda")

    def step(lens):
        kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        md.plan = planner.plan(kv_lens)  # outside the graph, into persistent buffers

    step([100] * batch)
    launch(q_nope, q_pe, cache, md, out)  # eager: sizes the LSE scratch before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(q_nope, q_pe, cache, md, out)
    for seed in range(3):
        lens = torch.randint(q_len, max_pages * PAGE, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
        lens[0] = q_len
        step(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = mla_decode((q_nope, q_pe), cache, md, SCALE, k_scale=K_SCALE if fp8 else None,
                                    return_lse=True)
        assert torch.equal(out, want), f"graph replay differs from mla_decode for lens {lens}"
        _close(out, want_lse, *_reference(q_nope, q_pe, cache, md, fp8))


def test_launcher_refuses_to_build_during_capture():
    _kernel_or_skip(16, 1, BF16)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(MLAInputError, match="built during CUDA-graph capture"):
        with torch.cuda.graph(graph):
            MLADecodeLauncher("cuda", 16, page_size=PAGE, dtype=BF16, softmax_scale=SCALE)


def test_launch_entries_keep_the_gil():
    """tvm-ffi functions release the GIL by default; the launch entries must not (an engine's IO threads would take it
    in the middle of a step)."""
    _kernel_or_skip(16, 1, BF16)
    variant = MLADecodeLauncher("cuda", 16, page_size=PAGE, dtype=BF16, softmax_scale=SCALE).variant(1)
    entries = [k for k in variant.kernels[:4] if k is not None and hasattr(type(k), "release_gil")]
    if not entries:
        pytest.skip("this TileLang release launches through its kernel objects, not tvm-ffi functions")
    assert [k.release_gil for k in entries] == [False] * len(entries)
