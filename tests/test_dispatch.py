"""Implementation choice: the reference on CPU (saying why), kernel limits, forced implementations."""

from __future__ import annotations

import re

import pytest
import torch

from mla_backend.dispatch import REFERENCE, kernel_unsupported, select_impl

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def test_auto_on_cpu_picks_reference_and_names_the_device():
    choice = select_impl(CPU, BF16, BF16, 128, 1, 64)
    assert choice.impl == REFERENCE
    assert "cpu" in choice.reason and "no GPU kernel" in choice.reason


def test_reference_can_be_requested():
    assert select_impl(CPU, BF16, BF16, 128, 1, 64, requested="reference").impl == REFERENCE


@pytest.mark.parametrize("impl", ["tilelang-sm90", "tilelang-gfx942"])
def test_forced_kernel_on_cpu_raises_with_the_reason(impl):
    with pytest.raises(ValueError, match=rf"impl='{impl}' cannot run here: no GPU kernel for device type 'cpu'"):
        select_impl(CPU, BF16, BF16, 128, 1, 64, requested=impl)


def test_unknown_impl():
    with pytest.raises(ValueError, match=r"impl='triton' is not supported; expected one of"):
        select_impl(CPU, BF16, BF16, 16, 1, 64, requested="triton")


@pytest.mark.parametrize("heads,q_len,page_size", [(1, 1, 1), (16, 2, 16), (128, 4, 64), (64, 3, 256)])
def test_kernel_supported_shapes(heads, q_len, page_size):
    assert kernel_unsupported(BF16, BF16, heads, q_len, page_size) is None
    assert kernel_unsupported(torch.float16, torch.float8_e4m3fn, heads, q_len, page_size) is None


@pytest.mark.parametrize("args,match", [
    ((BF16, BF16, 0, 1, 64), r"num_heads=0 \(kernels take 1\.\.128\)"),
    ((BF16, BF16, 256, 1, 64), r"num_heads=256"),
    ((BF16, BF16, 16, 5, 64), r"q_len=5 \(kernels take a uniform 1\.\.4"),
    ((BF16, BF16, 16, None, 64), r"q_len=None"),
    ((BF16, BF16, 16, 1, 3), r"page_size=3 \(kernels take 1, 2, 4"),
    ((BF16, BF16, 16, 1, 512), r"page_size=512"),
    ((torch.float32, torch.float32, 16, 1, 64), r"q dtype torch\.float32"),
    ((BF16, torch.float16, 16, 1, 64), r"kv_cache dtype torch\.float16 with q torch\.bfloat16"),
])
def test_kernel_unsupported_reasons(args, match):
    reason = kernel_unsupported(*args)
    assert reason is not None
    assert re.search(match, reason), reason


@pytest.mark.gpu
def test_auto_on_gpu_names_the_device_or_problem():
    dev = torch.device("cuda")
    choice = select_impl(dev, BF16, BF16, 128, 1, 64)
    assert choice.reason
    if choice.impl != REFERENCE:
        unsupported = select_impl(dev, BF16, BF16, 128, 1, 3)
        assert unsupported.impl == REFERENCE and "page_size=3" in unsupported.reason


def test_one_config_per_arch_read_from_no_environment(monkeypatch):
    """One Hopper design: config_for is a lookup, whatever the environment holds (the earlier MLA_BACKEND_SM90_*
    switches are gone), and the planner cuts work in its KV blocks."""
    from mla_backend.kernels import configs
    from mla_backend.planner import SplitPlanner

    assert configs.config_for("sm90") is configs.SM90 and configs.config_for("gfx942") is configs.GFX942
    monkeypatch.setenv("MLA_BACKEND_SM90_KERNEL", "seesaw")
    monkeypatch.setenv("MLA_BACKEND_SM90_CLUSTER", "0")
    assert configs.config_for("sm90") is configs.SM90
    assert SplitPlanner(4, 16, 1, "cpu", num_sms=8).block_n == configs.SM90.block_n == 64


def test_combine_choice_by_shape():
    """A short batch with many parts per request merges with the wide combine; one of >= 2048 rows in all with the
    tiled one where the variant has it (sm90); else per row."""
    from mla_backend.kernels.runtime import Kernels, pick_combine

    row, wide, tiled = "row", "wide", "tiled"  # stand-ins for the compiled kernels
    sm90 = Kernels(None, row, wide, tiled)
    gfx942 = Kernels(None, row, wide, None)
    assert pick_combine(sm90, 1, 16, 132) == wide  # b=1 h=16: 16 programs, 132 parts
    assert pick_combine(sm90, 16, 16, 132) == row  # 256 rows in all
    assert pick_combine(sm90, 64, 128, 66) == tiled and pick_combine(sm90, 16, 128, 66) == tiled
    assert pick_combine(sm90, 128, 32, 132) == tiled and pick_combine(sm90, 64, 16, 132) == row
    assert pick_combine(gfx942, 64, 128, 66) == row


def test_warmup_is_a_no_op_off_gpu():
    import mla_backend

    ready = mla_backend.warmup("cpu", 16, (1, 2), 64, BF16, BF16)
    assert ready.variants == () and ready.plan_variants == 0


def test_warmup_selects_per_shape(monkeypatch):
    """warmup: select_impl per q_len -> the arch's variants -> compiled once; a shape the kernels cannot run raises
    (strict) or is left out."""
    from mla_backend import dispatch
    from mla_backend.kernels import runtime

    monkeypatch.setattr(dispatch, "device_arch", lambda device: ("sm90", "NVIDIA H100 (sm_90)"))
    monkeypatch.setattr(dispatch, "tilelang_available", lambda: True)
    compiled = []
    monkeypatch.setattr(runtime, "warmup", lambda variants, workers=1: compiled.extend(variants) or 0.0)
    gpu = torch.device("cuda", 0)
    ready = dispatch.warmup(gpu, 16, (1, 2), 64, BF16, torch.float8_e4m3fn)
    assert ready.variants == tuple(compiled) == ((16, 1, 64, BF16, torch.float8_e4m3fn, "sm90", False),
                                                 (16, 2, 64, BF16, torch.float8_e4m3fn, "sm90", False))
    # fp8 compute: only the ws kernel's shapes (more than 16 rows) of an fp8 cache take it
    ready = dispatch.warmup(gpu, 16, (1, 2), 64, BF16, torch.float8_e4m3fn, fp8_compute=True)
    assert ready.variants == ((16, 1, 64, BF16, torch.float8_e4m3fn, "sm90", False),
                              (16, 2, 64, BF16, torch.float8_e4m3fn, "sm90", True))
    assert dispatch.warmup(gpu, 128, (1,), 64, BF16, BF16, fp8_compute=True).variants == (
        (128, 1, 64, BF16, BF16, "sm90", False),)
    with pytest.raises(RuntimeError, match=r"no TileLang kernel for heads=16 q_len=5"):
        dispatch.warmup(gpu, 16, (1, 5), 64, BF16, BF16)
    assert dispatch.warmup(gpu, 16, (5,), 64, BF16, BF16, strict=False).variants == ()
    shapes = [(128, 2, 1, BF16, BF16), (128, 2, 1, BF16, BF16), (16, 1, 3, BF16, BF16)]
    assert dispatch.warmup(gpu, shapes=shapes, strict=False).variants == ((128, 2, 1, BF16, BF16, "sm90", False),)


def test_engine_fp8_compute(monkeypatch):
    from mla_backend.dispatch import engine_fp8_compute

    monkeypatch.delenv("MLA_BACKEND_FP8_COMPUTE", raising=False)
    assert engine_fp8_compute() is True
    monkeypatch.setenv("MLA_BACKEND_FP8_COMPUTE", "0")
    assert engine_fp8_compute() is False
    monkeypatch.setenv("MLA_BACKEND_FP8_COMPUTE", "yes")
    with pytest.raises(ValueError, match=r"MLA_BACKEND_FP8_COMPUTE='yes' is not supported: 1 \(default\)"):
        engine_fp8_compute()


def test_fp8_compute_applies_and_its_config():
    from mla_backend.kernels.configs import SM90, config_for, fp8_compute_applies

    assert fp8_compute_applies("sm90", 128, 1, True) and fp8_compute_applies("sm90", 16, 2, True)
    assert not fp8_compute_applies("sm90", 16, 1, True)  # the memory-bound transposed kernel
    assert not fp8_compute_applies("sm90", 128, 1, False) and not fp8_compute_applies("gfx942", 128, 1, True)
    assert not fp8_compute_applies("sm90", 128, None, True)  # ragged: the reference
    assert config_for("sm90", True).fp8_compute and config_for("sm90", True).block_n == SM90.block_n
    assert not config_for("sm90").fp8_compute
    with pytest.raises(ValueError, match="sm90 kernel, not gfx942"):
        config_for("gfx942", True)


def test_engine_impl_request(monkeypatch):
    from mla_backend.dispatch import engine_impl_request

    monkeypatch.delenv("MLA_BACKEND_IMPL", raising=False)
    monkeypatch.delenv("MLA_BACKEND_SGLANG_IMPL", raising=False)
    assert engine_impl_request() == "auto"
    monkeypatch.setenv("MLA_BACKEND_SGLANG_IMPL", "reference")  # the older SGLang-only name
    assert engine_impl_request() == "reference"
    monkeypatch.setenv("MLA_BACKEND_IMPL", "tilelang-gfx942")
    assert engine_impl_request() == "tilelang-gfx942"
    monkeypatch.setenv("MLA_BACKEND_IMPL", "cuda")
    with pytest.raises(ValueError, match=r"MLA_BACKEND_IMPL='cuda' is not supported; expected one of"):
        engine_impl_request()


def test_fp8_cache_flavour_per_arch(monkeypatch):
    """Each kernel takes its GPU's e4m3: float8_e4m3fnuz on gfx942 (still behind the explicit opt-in), float8_e4m3fn
    on sm90; the other flavour is refused naming the argument, its value and what the kernel takes."""
    from mla_backend import dispatch

    monkeypatch.setattr(dispatch, "tilelang_available", lambda: True)
    gpu = torch.device("cuda", 0)
    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    assert dispatch.FP8_KV_DTYPES == {"sm90": fn, "gfx942": fnuz}

    monkeypatch.setattr(dispatch, "device_arch", lambda device: ("gfx942", "AMD Instinct MI300X (gfx942)"))
    for dtype in (BF16, torch.float16):
        assert select_impl(gpu, dtype, fnuz, 16, 1, 1, requested="tilelang-gfx942").impl == "tilelang-gfx942"
        assert select_impl(gpu, dtype, fnuz, 128, 2, 64, requested="tilelang-gfx942").impl == "tilelang-gfx942"
    auto = select_impl(gpu, BF16, fnuz, 16, 1, 1)  # unverified on hardware: the reference unless asked for
    assert auto.impl == REFERENCE and "pass impl='tilelang-gfx942'" in auto.reason
    with pytest.raises(ValueError, match=r"impl='tilelang-gfx942' cannot run here: unsupported "
                                         r"kv_cache\.dtype=torch\.float8_e4m3fn on gfx942: the gfx942 kernel takes a "
                                         r"float8_e4m3fnuz cache .* or the q dtype; an e4m3fn \(OCP\) cache would be "
                                         r"read as e4m3fnuz"):
        select_impl(gpu, BF16, fn, 16, 1, 1, requested="tilelang-gfx942")
    auto = select_impl(gpu, BF16, fn, 16, 1, 1)
    assert auto.impl == REFERENCE and "kv_cache.dtype=torch.float8_e4m3fn on gfx942" in auto.reason

    monkeypatch.setattr(dispatch, "device_arch", lambda device: ("sm90", "NVIDIA H100 (sm_90)"))
    assert select_impl(gpu, BF16, fn, 16, 1, 64).impl == "tilelang-sm90"
    with pytest.raises(ValueError, match=r"cannot run here: unsupported kv_cache\.dtype=torch\.float8_e4m3fnuz on "
                                         r"sm90: the sm90 kernel takes a float8_e4m3fn cache or the q dtype"):
        select_impl(gpu, BF16, fnuz, 16, 1, 64, requested="tilelang-sm90")
    auto = select_impl(gpu, BF16, fnuz, 16, 1, 64)
    assert auto.impl == REFERENCE and "float8_e4m3fnuz on sm90" in auto.reason


def test_other_fp8_formats_are_not_kernel_dtypes():
    reason = kernel_unsupported(BF16, torch.float8_e5m2, 16, 1, 64)
    assert reason == ("kv_cache dtype torch.float8_e5m2 with q torch.bfloat16 (kernels take the q dtype, "
                      "float8_e4m3fn on sm90 or float8_e4m3fnuz on gfx942)")
    assert kernel_unsupported(BF16, torch.float8_e4m3fnuz, 16, 1, 64) is None
