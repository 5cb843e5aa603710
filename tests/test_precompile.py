"""tests/precompile.py: the kernels read off the GPU test modules' collected items, the compile it asks for, and
nothing at all without a GPU. The last test compiles one item's kernels on the CPU (nvcc) and loads them in a fresh
process without compiling (marked slow: about two minutes on 2 cores)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import precompile

TESTS = Path(__file__).parent
BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
GPU_MODULES = ("test_kernel_gpu.py", "test_kernel_gpu_adversarial.py", "test_launcher_gpu.py")

# What each module's tests build, written out from their bodies: (heads, q_len, page_size, q dtype, kv dtype)
KERNEL_GPU = ([(16, 1, p, BF16, BF16) for p in (1, 16, 32, 64, 128)] + [(h, 1, 64, BF16, BF16) for h in (1, 32, 64, 128)]
              + [(16, 2, 64, BF16, BF16), (128, 2, 64, BF16, BF16), (16, 3, 16, BF16, BF16), (32, 4, 1, BF16, BF16),
                 (128, 4, 16, BF16, BF16), (16, 1, 64, FP16, FP16), (16, 1, 64, BF16, FP8), (16, 1, 64, FP16, FP8),
                 (16, 1, 1, BF16, FP8), (128, 2, 16, BF16, FP8), (16, 1, 16, BF16, FP8), (16, 1, 128, FP16, FP8),
                 (8, 2, 32, BF16, FP8), (128, 1, 1, BF16, BF16), (128, 1, 16, BF16, BF16), (128, 1, 32, BF16, BF16),
                 (64, 2, 16, BF16, BF16), (128, 2, 1, FP16, FP16)]
              + [(h, q, p, dt, FP8, True) for h, q, p, dt in ((128, 1, 64, BF16), (128, 2, 64, BF16), (64, 2, 16, BF16),
                                                            (32, 1, 64, BF16), (128, 1, 1, BF16), (16, 2, 64, FP16))])
ADVERSARIAL = [(16, 1, 1, BF16, BF16), (16, 1, 64, BF16, BF16), (16, 2, 64, BF16, BF16)]
LAUNCHER = [(h, q, 64, BF16, kv) for h in (16, 32, 128) for q in (1, 2) for kv in (BF16, FP8)]


def cache_entries(cache: Path) -> list[Path]:
    """The kernel entries of a TileLang cache holding one release."""
    from mla_backend.kernels.prebuilt import _entries_dir

    root = _entries_dir(cache)
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root else []


@pytest.mark.parametrize("layout", ["0.1.9-linux_x86_64/kernels", "0.1.15/linux-x86_64/kernels"])
def test_cache_entries_in_each_tilelang_layout(tmp_path, layout):
    (tmp_path / layout / "abc").mkdir(parents=True)
    (tmp_path / layout.rsplit("/", 1)[0] / "staging").mkdir()
    assert cache_entries(tmp_path) == [tmp_path / layout / "abc"]
    assert cache_entries(tmp_path / "empty") == []


def collect(*args) -> list:
    """The items a ``pytest --collect-only`` of ``args`` selects (tests/conftest.py loaded, so no GPU: nothing built)."""
    items = []

    class Keep:
        def pytest_collection_finish(self, session):
            items.extend(session.items)

    code = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", *args], plugins=[Keep()])
    assert code == 0
    return items


@pytest.fixture(scope="module")
def gpu_items():
    return collect(*(str(TESTS / m) for m in GPU_MODULES))


def test_variants_of_each_gpu_module(gpu_items):
    for module, want in zip(GPU_MODULES, (KERNEL_GPU, ADVERSARIAL, LAUNCHER)):
        items = [i for i in gpu_items if i.path.name == module]
        assert items and all(precompile.item_kernels(i)[0] for i in items), module
        assert set(precompile.collected_kernels(items)[0]) == set(want), module


def test_planners_of_the_gpu_modules(gpu_items):
    _, plans = precompile.collected_kernels(gpu_items)
    assert set(plans) == {(256, None), (257, None), (300, None), (512, None), (1024, None), (2, 32)}


def test_one_selected_item_gives_its_variant_only(gpu_items):
    item = next(i for i in gpu_items if i.name == "test_fp8_cache[16-1-128-dtype5]")
    assert precompile.collected_kernels([item]) == ([(16, 1, 128, FP16, FP8)], [(256, None)])
    item = next(i for i in gpu_items if i.name == "test_launcher_equals_mla_decode_and_reference[128-lens1-2-True]")
    assert precompile.item_kernels(item)[0] == {(128, 2, 64, BF16, FP8)}


def test_gpu_tests_without_the_marker_build_nothing():
    items = collect(str(TESTS / "test_dispatch.py"), str(TESTS / "test_validation.py"), "-m", "gpu")
    assert items and precompile.collected_kernels(items) == ([], [])


def test_compile_request(monkeypatch):
    """compile_variants gets the dtypes by torch name, one planner per power-of-two size, sm90's blocks unless named,
    no variant the kernels refuse, and no more workers than variants."""
    pytest.importorskip("tilelang")
    from mla_backend.kernels import prebuilt

    calls = []

    def record(variants, plan_batches, block_n, workers):
        calls.append((variants, plan_batches, block_n, workers))
        return {str(v): 1.0 for v in [*variants, *plan_batches]}

    monkeypatch.setattr(prebuilt, "compile_variants", record)
    variants = [(16, 1, 64, BF16, FP8), (128, 2, 1, FP16, FP16), (16, 1, 3, BF16, BF16), (16, 1, 64, FP16, BF16)]
    names, _ = precompile.compile_for_sm90(variants, [(256, None), (300, None), (512, None), (2, 32)], workers=64)
    assert calls == [([(16, 1, 64, "bfloat16", "float8_e4m3fn"), (128, 2, 1, "float16", "float16")],
                      [(256, 32), (256, 64), (512, 64)], 64, 5)]
    assert len(names) == 5


def test_nothing_without_a_gpu_or_when_switched_off(gpu_items, monkeypatch):
    from mla_backend.kernels import prebuilt

    def refuse(*args, **kwargs):
        raise AssertionError("compile_variants called")

    monkeypatch.setattr(prebuilt, "compile_variants", refuse)
    lines = []
    if not torch.cuda.is_available():
        assert precompile.precompile(gpu_items, lines.append) == []
    monkeypatch.setenv(precompile.ENV_SWITCH, "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert precompile.precompile(gpu_items, lines.append) == [] and lines == []


def test_on_hopper_one_line_and_no_failure(gpu_items, monkeypatch):
    """With an sm90 GPU (stood in for here) all 39 variants and 4 planners go to one compile_variants call, reported in
    one line; a failed compile is reported and leaves the tests to compile."""
    pytest.importorskip("tilelang")
    from mla_backend import dispatch
    from mla_backend.kernels import prebuilt

    calls = []

    def record(variants, plan_batches, block_n, workers):
        calls.append(len(variants) + len(plan_batches))
        return {str(v): 1.0 for v in [*variants, *plan_batches]}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_arch", lambda device: ("sm90", "an H100"))
    monkeypatch.setattr(prebuilt, "compile_variants", record)
    lines = []
    assert len(precompile.precompile(gpu_items, lines.append)) == 43 and calls == [43]
    assert len(lines) == 1 and lines[0].startswith("mla_backend: 43 kernel variants and planners compiled"), lines

    def fail(*args, **kwargs):
        raise RuntimeError("BrokenProcessPool")

    monkeypatch.setattr(prebuilt, "compile_variants", fail)
    assert precompile.precompile(gpu_items, lines.append) == [] and "failed (RuntimeError" in lines[-1]


LOAD = textwrap.dedent("""
    import torch
    from mla_backend.kernels.plan_kernel import get_plan_kernel
    from mla_backend.kernels.runtime import get_kernels
    get_kernels(16, 2, 64, torch.bfloat16, torch.bfloat16, "sm90")  # what mla_decode asks for
    get_plan_kernel(64, 64)  # a SplitPlanner of 64 requests on sm90
""")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc compiles the kernels")
def test_precompiled_item_loads_without_compiling(gpu_items, tmp_path, monkeypatch):
    pytest.importorskip("tilelang")
    item = next(i for i in gpu_items if i.name == "test_every_request_empty_but_one[first-2]")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(cache))
    names, _ = precompile.compile_for_sm90(*precompile.collected_kernels([item]), workers=2)
    assert sorted(names) == ["h16-q2-p64-bfloat16-bfloat16", "plan-b256-n64"]
    entries = cache_entries(cache)
    assert len(entries) == 5  # split, three combines, planner
    run = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TILELANG_CACHE_DIR": str(cache)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "begins to compile" not in run.stdout + run.stderr
    assert cache_entries(cache) == entries
