"""Prebuilt kernels: ``compile_variants(into_package=True)`` packs TileLang cache entries with a manifest (adding to
what the folder holds, or ``fresh``), and a fresh process with an empty TileLang cache and no nvcc on its PATH loads
them instead of compiling.

Uses the one-launch planner kernel (the quickest sm_90a kernel to build); the decode variants take the same path.
Lowering and nvcc run on the CPU; loading the entry needs no GPU.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("tilelang")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is needed to build the entries")

LOAD = textwrap.dedent("""
    import json, pathlib, sys, time
    from mla_backend.kernels import prebuilt
    prebuilt.PACKAGE_DIR = pathlib.Path(sys.argv[1])
    from mla_backend.kernels.plan_kernel import get_plan_kernel
    start = time.perf_counter()
    get_plan_kernel(256, 64)
    print(json.dumps({"seconds": time.perf_counter() - start}))
""")


@pytest.mark.slow
@needs_nvcc
def test_prebuilt_planner_loads_without_nvcc(tmp_path, monkeypatch):
    from mla_backend.kernels import prebuilt

    package = tmp_path / "prebuilt"
    monkeypatch.setattr(prebuilt, "PACKAGE_DIR", package)
    seconds = prebuilt.compile_variants([], plan_batches=(256,), into_package=True, progress=None)
    assert list(seconds) == [prebuilt.plan_name(256, 64)]
    release = package / prebuilt.installed_tilelang()
    assert prebuilt.packaged_releases() == [release.name]
    manifest = json.loads((release / prebuilt.MANIFEST).read_text())
    keys = manifest["variants"][prebuilt.plan_name(256, 64)]
    assert len(keys) == 1 and (release / "entries" / keys[0] / "executable.so").is_file()

    cache = tmp_path / "user-cache"
    nvcc_free_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                     if not os.path.exists(os.path.join(p, "nvcc")))
    env = dict(os.environ, TILELANG_CACHE_DIR=str(cache), PATH=nvcc_free_path, CUDA_HOME="/nonexistent")
    env.pop("CUDA_PATH", None)
    run = subprocess.run([sys.executable, "-c", LOAD, str(package)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # Loaded, not compiled: the seeded entry is the only one in the cache (a compile under another key would add its
    # own), and TileLang never announced a compile.
    entries = sorted(p.name for p in (cache / manifest["cache_subdir"]).iterdir() if not p.name.startswith("."))
    assert entries == keys
    assert (cache / manifest["cache_subdir"] / keys[0] / "executable.so").is_file()
    assert "begins to compile" not in run.stdout + run.stderr


def test_no_manifest_means_no_prebuilt(tmp_path, monkeypatch):
    from mla_backend.kernels import prebuilt

    monkeypatch.setattr(prebuilt, "PACKAGE_DIR", tmp_path / "empty")
    monkeypatch.setattr(prebuilt, "_manifest", None)
    assert prebuilt.seed(prebuilt.variant_name(16, 1, 64, "bfloat16", "bfloat16")) is False


def test_another_release_is_not_seeded(tmp_path, monkeypatch):
    """A folder compiled with another TileLang release is never copied into this one's cache."""
    from mla_backend.kernels import prebuilt

    name = prebuilt.variant_name(16, 1, 64, "bfloat16", "bfloat16")
    other = tmp_path / "prebuilt" / "0.0.1"
    (other / "entries" / "k0").mkdir(parents=True)
    (other / prebuilt.MANIFEST).write_text(json.dumps({"tilelang": "0.0.1", "cache_subdir": "0.0.1-x/kernels",
                                                       "variants": {name: ["k0"]}}))
    monkeypatch.setattr(prebuilt, "PACKAGE_DIR", tmp_path / "prebuilt")
    monkeypatch.setattr(prebuilt, "_manifest", None)
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    assert prebuilt.packaged_releases() == ["0.0.1"]
    assert prebuilt.seed(name) is False
    assert not (tmp_path / "cache").exists()


def _fake_build(scratch, i, keys, subdir="9.9.9/linux-x86_64/kernels"):
    """What one compile task leaves in its private cache: an entry folder per key."""
    for key in keys:
        (scratch / str(i) / subdir / key).mkdir(parents=True)
        (scratch / str(i) / subdir / key / "executable.so").write_text(key)


def test_into_package_adds_to_the_release_folder_and_fresh_replaces_it(tmp_path, monkeypatch):
    """Two builds with different heads add up (a variant built again takes its new entries, an entry no variant
    names is removed); ``fresh`` keeps only the last build; a build for another cache namespace starts over."""
    from mla_backend.kernels import prebuilt

    monkeypatch.setattr(prebuilt, "PACKAGE_DIR", tmp_path / "prebuilt")
    monkeypatch.setattr(prebuilt, "installed_tilelang", lambda: "9.9.9")
    h64, h128 = (prebuilt.variant_name(h, 1, 64, "bfloat16", "bfloat16") for h in (64, 128))
    plan = prebuilt.plan_name(256, 64)
    entries = tmp_path / "prebuilt" / "9.9.9" / "entries"

    def build(names_keys, fresh=False, subdir="9.9.9/linux-x86_64/kernels"):
        scratch = tmp_path / f"scratch{len(list(tmp_path.iterdir()))}"
        for i, (_name, keys) in enumerate(names_keys):
            _fake_build(scratch, i, keys, subdir)
        prebuilt._pack_release([(n, ()) for n, _ in names_keys], dict(names_keys), scratch, fresh)

    build([(h64, ["a"]), (plan, ["p1"])])
    build([(h128, ["b"]), (plan, ["p2"])])
    assert prebuilt.release_variants() == sorted([h64, h128, plan])
    assert sorted(p.name for p in entries.iterdir()) == ["a", "b", "p2"]  # p1: the planner's old build, unnamed
    assert prebuilt._Manifest(entries.parent).keys_for(plan) == ["p2"]

    build([(h128, ["c"])], fresh=True)
    assert prebuilt.release_variants() == [h128] and [p.name for p in entries.iterdir()] == ["c"]

    build([(h64, ["d"])], subdir="9.9.9/otherplatform/kernels")
    assert prebuilt.release_variants() == [h64] and [p.name for p in entries.iterdir()] == ["d"]
