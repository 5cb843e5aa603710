"""Implementation choice: the reference on CPU (saying why), kernel limits, forced implementations."""

from __future__ import annotations

import os
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


def test_sm90_kernel_choice_follows_the_environment(monkeypatch):
    from mla_backend.kernels import configs
    from mla_backend.planner import SplitPlanner

    monkeypatch.delenv(configs.SM90_KERNEL_ENV, raising=False)
    assert configs.config_for("sm90") is configs.SM90_KERNELS[configs.DEFAULT_SM90_KERNEL]
    monkeypatch.setenv(configs.SM90_KERNEL_ENV, "ws")
    assert configs.config_for("sm90") is configs.SM90_WS
    # the planner cuts work in the chosen kernel's KV blocks (64 tokens for the warp-specialised one)
    assert SplitPlanner(4, 16, 1, "cpu", num_sms=8).block_n == configs.SM90_WS.block_n
    assert configs.config_for("gfx942") is configs.GFX942  # not affected
    monkeypatch.setenv(configs.SM90_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match=r"MLA_BACKEND_SM90_KERNEL='fast' is not supported; expected one of"):
        configs.config_for("sm90")


@pytest.mark.parametrize("fast", [True, False])
def test_settings_read_as_os_environ_does(monkeypatch, fast):
    """env_get (the op's hot-path reader) sees what os.environ.get sees after every kind of change: set, delete,
    mock.patch.dict and its undo; config_for's cache follows the switches, and an invalid value raises every time.
    Both through the environment's bytes dict (POSIX CPython) and through os.environ (the fallback)."""
    from unittest import mock

    from mla_backend.kernels import configs

    if fast and not configs._FAST_ENV:
        pytest.skip("no os.environ._data here: env_get reads os.environ")
    monkeypatch.setattr(configs, "_FAST_ENV", fast)
    name = configs.SM90_CLUSTER_ENV
    monkeypatch.delenv(name, raising=False)
    assert configs.env_get(name) is None and configs.env_get(name, "x") == "x"
    assert configs.config_for("sm90").cluster_kv
    monkeypatch.setenv(name, "0")
    assert configs.env_get(name) == os.environ.get(name) == "0"
    assert not configs.config_for("sm90").cluster_kv
    with mock.patch.dict(os.environ, {name: "1", configs.SM90_TMA_ENV: "0"}):
        assert configs.env_get(name) == "1" and configs.env_get(configs.SM90_TMA_ENV) == "0"
        cfg = configs.config_for("sm90")
        assert cfg.cluster_kv and not cfg.tma_kv
    assert configs.env_get(name) == "0" and configs.env_get(configs.SM90_TMA_ENV) == os.environ.get(configs.SM90_TMA_ENV)
    assert not configs.config_for("sm90").cluster_kv
    monkeypatch.delenv(name)
    assert configs.config_for("sm90") is configs.SM90_KERNELS[configs.DEFAULT_SM90_KERNEL]
    monkeypatch.setenv(name, "maybe")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"MLA_BACKEND_SM90_CLUSTER='maybe' is not supported; expected 0 or 1"):
            configs.config_for("sm90")


def test_combine_choice_by_shape_and_environment(monkeypatch):
    """A short batch with many parts per request merges with the wide combine; one of >= 2048 rows in all with the
    tiled one where the variant has it (sm90); else per row. MLA_BACKEND_COMBINE forces one and is validated."""
    from mla_backend.kernels.runtime import COMBINE_ENV, Kernels, pick_combine

    row, wide, tiled = "row", "wide", "tiled"  # stand-ins for the compiled kernels
    sm90 = Kernels(None, row, wide, tiled, 2)
    gfx942 = Kernels(None, row, wide, None, 0)
    monkeypatch.delenv(COMBINE_ENV, raising=False)
    assert pick_combine(sm90, 1, 16, 132) == wide  # b=1 h=16: 16 programs, 132 parts
    assert pick_combine(sm90, 16, 16, 132) == row  # 256 rows in all
    assert pick_combine(sm90, 64, 128, 66) == tiled and pick_combine(sm90, 16, 128, 66) == tiled
    assert pick_combine(sm90, 128, 32, 132) == tiled and pick_combine(sm90, 64, 16, 132) == row
    assert pick_combine(gfx942, 64, 128, 66) == row
    monkeypatch.setenv(COMBINE_ENV, "tiled")
    assert pick_combine(sm90, 1, 16, 132) == tiled
    with pytest.raises(ValueError, match=r"MLA_BACKEND_COMBINE='tiled': this kernel variant has no tiled"):
        pick_combine(gfx942, 1, 16, 132)
    monkeypatch.setenv(COMBINE_ENV, "grouped")
    with pytest.raises(ValueError, match=r"MLA_BACKEND_COMBINE='grouped' is not supported; expected one of"):
        pick_combine(sm90, 1, 16, 132)


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


def test_fp8_cache_refused_on_gfx942(monkeypatch):
    """The gfx942 config has no room for the fp8 staging tile: refused with the reason, not a launch failure."""
    from mla_backend import dispatch

    monkeypatch.setattr(dispatch, "device_arch", lambda device: ("gfx942", "AMD Instinct MI300X (gfx942)"))
    monkeypatch.setattr(dispatch, "tilelang_available", lambda: True)
    gpu = torch.device("cuda", 0)
    assert select_impl(gpu, BF16, BF16, 16, 1, 1, requested="tilelang-gfx942").impl == "tilelang-gfx942"
    with pytest.raises(ValueError, match=r"float8_e4m3fn cache is not supported by the gfx942 kernel"):
        select_impl(gpu, BF16, torch.float8_e4m3fn, 16, 1, 1, requested="tilelang-gfx942")
    auto = select_impl(gpu, BF16, torch.float8_e4m3fn, 16, 1, 1)
    assert auto.impl == REFERENCE and "float8_e4m3fn" in auto.reason
