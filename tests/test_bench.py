"""The decode benchmark on CPU: what ``--fp8`` adds, which cache each impl reads, the mixed and served configs."""

from __future__ import annotations

import dataclasses

import pytest

from mla_backend import bench, bench_report


def test_fp8_adds_both_of_ours_and_the_anchors_fp8_paths():
    assert bench.impl_list("ours,flashmla", fp8=False) == ["ours", "flashmla"]
    assert bench.impl_list("ours,flashmla,fa3", fp8=True) == ["ours", "flashmla", "fa3", "ours-fp8", "ours-fp8c",
                                                              "flashmla-fp8", "flashmla-fp8q"]
    with pytest.raises(ValueError, match=r"unknown impl\(s\) \['ours-fp8c'\]"):
        bench.impl_list("ours-fp8c", fp8=True)


def test_sglang_flashmla_build_is_an_anchor_of_its_own():
    """flashmla-sgl (FlashMLA as SGLang's sgl-kernel builds it) is listed after vLLM's FlashMLA, has no fp8 path here,
    counts as a best anchor, and where sgl-kernel does not import it is skipped with SGLang named in the reason."""
    import importlib.util

    assert bench.impl_list("flashmla-sgl,ours,flashmla", fp8=True) == ["ours", "flashmla", "flashmla-sgl", "ours-fp8",
                                                                        "ours-fp8c", "flashmla-fp8", "flashmla-fp8q"]
    assert bench.base_impl("flashmla-sgl") == "flashmla-sgl" and not bench.fp8_kv("flashmla-sgl")
    anchor = bench.load_anchors({"flashmla-sgl"})["flashmla-sgl"]
    if importlib.util.find_spec("sgl_kernel") is None:
        assert isinstance(anchor, str) and anchor.startswith("cannot import SGLang's flashmla-sgl kernel"), anchor
    else:
        assert isinstance(anchor, str) or callable(anchor.flash_mla_with_kvcache)
    env = {"gpu": "H200", "date": "2026-11-30T12:00", "torch": "2.11", "cuda_runtime": "13.0", "triton": "3.6",
           "vllm": None, "tilelang": "0.1.11", "sm90_kernel": "tws", "driver": "580", "git": "abc", "command": "c"}
    header = bench_report.markdown([], ["ours", "flashmla-sgl"], {**env, "sglang-kernel": "0.4.5"}, {"timing": "t"})
    assert "sgl-kernel 0.4.5, driver 580" in header and "min(FlashMLA, FlashMLA (sgl-kernel), FA3)" in header
    plain = bench_report.markdown([], ["ours"], {**env, "sglang-kernel": None}, {"timing": "t"})
    assert "sgl-kernel" not in plain.split("\n")[2]


def test_sm_clock_while_timed_is_summarised_per_impl():
    """The report's clock line: per impl the lowest and highest of its configs' median NVML samples, impls without
    samples left out, no line at all without any; without an NVIDIA GPU there is no clock reader."""
    import torch

    results = [{"impls": {"ours": {"us": 50.0, "sm_mhz": 1980.0}, "flashmla-sgl": {"us": 49.0, "sm_mhz": 1755.0}}},
               {"impls": {"ours": {"us": 900.0, "sm_mhz": 1830.0}, "flashmla-sgl": {"skip": "page 16"}}},
               {"impls": {"ours": {"us": 80.0, "sm_mhz": None}}}]
    assert bench_report.clock_summary(results, ["ours", "flashmla-sgl", "fa3"]) == (
        "SM clock while timed (NVML samples, median per config), MHz: ours 1830-1980, flashmla-sgl 1755.")
    assert bench_report.clock_summary(results[2:], ["ours"]) is None
    if not torch.cuda.is_available():
        assert bench.sm_clock_reader(torch.device("cpu")) is None


def test_fp8_cache_readers_and_their_implementation():
    assert [bench.fp8_kv(n) for n in ("ours", "ours-fp8", "ours-fp8c", "flashmla-fp8", "flashmla-fp8q", "fa3")] == [
        False, True, True, True, True, False]
    assert [bench.base_impl(n) for n in ("ours-fp8c", "ours-fp8", "flashmla-fp8", "flashmla-fp8q", "fa3")] == [
        "ours", "ours", "flashmla", "flashmla", "fa3"]
    # ours-fp8c quantises q as flashmla-fp8 does: a looser warning threshold than the exact-q fp8 path
    assert bench.tolerance("ours-fp8") < bench.tolerance("ours-fp8c") < bench.tolerance("flashmla-fp8")
    assert bench.tolerance("flashmla-fp8q") == bench.tolerance("flashmla-fp8")


def test_vllm_q_quantisation_for_flashmla_fp8():
    """flashmla-fp8q's q equals what vLLM's own op hands FlashMLA's fp8 kernel (concatenated, times 1 / scale,
    clamped to +-448, e4m3) on random values, some of which saturate."""
    import torch

    pytest.importorskip("vllm")
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    gen = torch.Generator().manual_seed(0)
    q_nope, q_pe = (torch.randn(3, 4, n, generator=gen).mul(100).to(torch.bfloat16) for n in (512, 64))
    scale = torch.tensor([0.5])
    q8 = bench.concat_quantise_q(q_nope, q_pe, scale)
    assert q8.shape == (3, 4, 576) and q8.dtype == torch.float8_e4m3fn
    assert (q8.float().abs() == 448).any()  # some saturate, none overflow
    flat = torch.cat((q_nope, q_pe), dim=-1).reshape(3, -1)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        quant = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)
        expect, _ = quant.forward_native(flat, scale)
    assert torch.equal(q8.view(torch.uint8).reshape(3, -1), expect.view(torch.uint8))


def test_mixed_grid_is_short_ragged_requests_and_one_long_one():
    every = bench.make_configs("mixed")
    assert {(c.b, c.long_len) for c in every} == {(64, 0), (65, 16384)}
    cfgs = [c for c in every if c.long_len]
    assert {(c.h, c.s_q) for c in cfgs} == {(16, 1), (16, 2), (128, 1), (128, 2)}
    lens = bench.seq_lens(cfgs[0])
    assert len(lens) == 65 and lens[-1] == 16384 and max(lens[:-1]) <= 2048 and len(set(lens[:-1])) > 10
    assert cfgs[0].label().endswith("ragged +1x16384 p64")
    # its own KV group (the long request changes the cache), and the filter finds it by kind and by long_len
    assert cfgs[0].kv_key() != dataclasses.replace(cfgs[0], long_len=0).kv_key()
    full = bench.make_configs("full")
    assert bench.select(full, ["kind=mixed"]) == every and bench.select(full, ["long_len=16384"]) == cfgs


def test_served_grid_is_4k_prompts_decoded_from_different_steps():
    every = bench.make_configs("served")
    assert {(c.b, c.s_k, c.h, c.s_q) for c in every} == {(b, 4096, h, sq) for b in (16, 64) for h in (64, 128)
                                                       for sq in (1, 2)}
    cfg = next(c for c in every if c.b == 64)
    lens = bench.seq_lens(cfg)
    assert len(lens) == 64 and 4096 <= min(lens) and max(lens) < 4096 + bench.SERVED_SPREAD and len(set(lens)) > 30
    assert lens == bench.seq_lens(cfg) and lens != bench.seq_lens(cfg, seed=1)  # seeded
    assert cfg.label() == f"b=64 s_k=4096 h={cfg.h} s_q={cfg.s_q} spread{bench.SERVED_SPREAD} p64"
    # its own KV group (not the grid's ragged 4k cache), and the filter finds it by kind, lens and spread
    assert cfg.kv_key() != dataclasses.replace(cfg, spread=0).kv_key()
    full = bench.make_configs("full")
    assert bench.select(full, ["kind=served"]) == every == bench.select(full, [f"spread={bench.SERVED_SPREAD}"])
    assert bench.select(full, [f"lens=spread{bench.SERVED_SPREAD},b=16"]) == [c for c in every if c.b == 16]
