"""Kernels shipped compiled: TileLang disk-cache entries packed into the wheel, and the command that builds them.

TileLang keys a compiled kernel by its TIR, target, pass configs and the TileLang build (version, platform and a
hash of ``libtilelang.so``), and keeps it under ``TILELANG_CACHE_DIR/<version>-<platform>/kernels/<key>/``. An entry
holds the generated sources and ``executable.so`` (host launcher + sm_90a cubin), so loading it needs neither nvcc
nor a GPU-side JIT. ``mla-backend compile --into-package`` fills ``mla_backend/kernels/prebuilt/<TileLang version>/``
with the entries of the variants engines use (``ENGINE_*`` below) and a manifest; at run time ``seed(variant)`` copies
a variant's entries into the user's TileLang cache before the first compile, so ``tilelang.compile`` finds them there.

Entries serve only the TileLang release they were compiled with, and engines pin different releases (vLLM 0.26:
0.1.9, SGLang 0.5.17: 0.1.11, ...), so the package folder holds one set per release, ``prebuilt/<version>/``: a wheel
built after ``mla-backend compile --into-package`` ran under each release carries them all, and ``seed`` uses the set
of the installed one. With a release the wheel has no set for, the kernels JIT-compile and cache as before, and
``seed`` says so once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger("mla_backend")

PACKAGE_DIR = Path(__file__).with_name("prebuilt")
MANIFEST = "manifest.json"

# DeepSeek-V3 at TP1..TP8 (128 / 64 / 32 / 16 heads per GPU), decode and MTP with up to three drafts (SGLang's
# default for DeepSeek-V3 with EAGLE is 3 steps, 4 draft tokens: q_len 4), the page sizes of SGLang (1, and 64 for
# FlashMLA-style pools) and vLLM (16 and 64), a bf16 or fp8 cache.
ENGINE_HEADS = (16, 32, 64, 128)
ENGINE_Q_LENS = (1, 2, 3, 4)
ENGINE_PAGE_SIZES = (1, 16, 64)
ENGINE_DTYPE = "bfloat16"  # of q
ENGINE_KV_DTYPES = ("bfloat16", "float8_e4m3fn")  # an fp8 cache: with and without fp8 compute where it applies
# One planner kernel per power of two of the largest batch, up to 4096 requests.
ENGINE_PLAN_BATCHES = (256, 512, 1024, 2048, 4096)


def variant_name(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                 fp8_compute: bool = False) -> str:
    return f"h{num_heads}-q{q_len}-p{page_size}-{dtype}-{kv_dtype}" + ("-fp8compute" if fp8_compute else "")


def plan_name(max_batch: int, block_n: int) -> str:
    return f"plan-b{max_batch}-n{block_n}"


def _tilelang_cache_dir() -> Path:
    """TileLang's disk cache (``TILELANG_CACHE_DIR``, read by TileLang at import)."""
    from tilelang.env import env

    return Path(env.TILELANG_CACHE_DIR)


def installed_tilelang() -> str:
    import tilelang

    return tilelang.__version__


def release_dir(version: str | None = None) -> Path:
    """``PACKAGE_DIR/<TileLang version>``: the entries and manifest compiled with that release (default: installed)."""
    return PACKAGE_DIR / (version or installed_tilelang())


def packaged_releases() -> list[str]:
    """The TileLang releases the package carries compiled kernels for."""
    return sorted(d.name for d in PACKAGE_DIR.glob("*") if (d / MANIFEST).is_file())


def _entries_dir(cache_dir: Path) -> Path | None:
    """The folder of entries under a TileLang cache (one TileLang per cache here): ``<version>-<platform>/kernels``
    up to 0.1.12, ``<version>/<platform>-<machine>/kernels`` from 0.1.15."""
    found = sorted(p for pattern in ("*/kernels", "*/*/kernels") for p in cache_dir.glob(pattern) if p.is_dir())
    return found[0] if found else None


class _Manifest:
    """What one release folder holds: the TileLang version and cache namespace it was built with, and the cache keys
    of each variant (a combine shared by several variants is stored once)."""

    def __init__(self, root: Path):
        self.root = root
        path = root / MANIFEST
        self.data = json.loads(path.read_text()) if path.is_file() else None

    def keys_for(self, name: str) -> list[str] | None:
        return None if self.data is None else self.data["variants"].get(name)


_manifest: _Manifest | None = None
_mismatch_logged = False


def _release_manifest() -> _Manifest:
    """The installed TileLang's release folder, read once per process."""
    global _manifest
    if _manifest is None:
        _manifest = _Manifest(release_dir())
    return _manifest


def release_variants(version: str | None = None) -> list[str]:
    """The variant (and planner) names the release folder holds, sorted; [] without one."""
    data = _Manifest(release_dir(version)).data
    return sorted(data["variants"]) if data is not None else []


def seed(name: str) -> bool:
    """Copies variant ``name``'s prebuilt entries into TileLang's cache (once; entries already there are kept).
    Returns whether the wheel carries the variant for the installed TileLang."""
    global _mismatch_logged
    manifest = _release_manifest()
    if manifest.data is None:
        releases = packaged_releases()
        if releases and not _mismatch_logged:
            logger.info("mla_backend: the package carries kernels compiled with TileLang %s; TileLang %s is installed, "
                        "so kernels JIT-compile on first use", ", ".join(releases), installed_tilelang())
            _mismatch_logged = True
        return False
    keys = manifest.keys_for(name)
    if keys is None:
        return False
    dest_root = _tilelang_cache_dir() / manifest.data["cache_subdir"]
    dest_root.mkdir(parents=True, exist_ok=True)
    for key in keys:
        dest = dest_root / key
        if not dest.exists():
            tmp = dest_root / f".{key}.mla_backend_tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(manifest.root / "entries" / key, tmp)
            try:
                os.replace(tmp, dest)  # atomic: a concurrent process sees no half-copied entry
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return True


def seed_all() -> int:
    """Copies every variant the package carries for the installed TileLang into TileLang's cache; returns how many.
    A copy, not a compile: serve-bench seeds before an engine starts, so that what the start adds to the cache is
    what it compiled."""
    data = _release_manifest().data
    return sum(seed(name) for name in (data["variants"] if data is not None else ()))


# ---- building: mla-backend compile ------------------------------------------------------------------------------

def _compile_into(task: tuple) -> tuple[str, list[str], float]:
    """Worker: compiles one variant (or planner) into a private TileLang cache dir and lists the entries it made.
    Runs in a fresh process, so ``TILELANG_CACHE_DIR`` is set before TileLang is imported."""
    name, spec, cache_dir = task
    os.environ["TILELANG_CACHE_DIR"] = cache_dir
    import time

    import torch

    start = time.perf_counter()
    if spec[0] == "plan":
        from .plan_kernel import get_plan_kernel

        get_plan_kernel(spec[1], spec[2])
    else:
        from .configs import config_for
        from .runtime import get_kernels

        heads, q_len, page, dtype, kv_dtype, *fp8_compute = spec
        get_kernels(heads, q_len, page, getattr(torch, dtype), getattr(torch, kv_dtype), "sm90",
                    config_for("sm90", bool(fp8_compute and fp8_compute[0])))
    kernels_dir = _entries_dir(Path(cache_dir))
    keys = sorted(p.name for p in kernels_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    return name, keys, time.perf_counter() - start


def compile_variants(variants: list[tuple], plan_batches: tuple[int, ...] = (), block_n: int = 64,
                     into_package: bool = False, workers: int = 1, progress=None, fresh: bool = False) -> dict:
    """Compiles ``(num_heads, q_len, page_size, dtype, kv_dtype[, fp8_compute])`` variants for sm_90a (no GPU
    needed; nvcc is).

    Without ``into_package`` each lands in TileLang's own cache (ahead-of-time warm-up of this machine). With it, the
    variants go into the installed TileLang's release folder (``release_dir()``): ``entries/<key>/`` and
    ``manifest.json``, which a wheel then carries. The variants the folder already holds and this call does not
    compile are kept (two calls with different ``--heads`` add up), unless ``fresh``, which rebuilds it from
    scratch; entries no variant names are removed. Other releases' folders are kept.
    ``plan_batches``: the planner kernels' max batches, each an int (cut in ``block_n``-token blocks) or a
    ``(max_batch, block_n)`` pair. ``progress(done, total, name, seconds)`` is called as each one finishes.
    Returns ``{name: seconds}``.
    """
    import concurrent.futures
    import multiprocessing
    import tempfile

    tasks = [(variant_name(*v), tuple(v)) for v in variants]
    plans = [p if isinstance(p, tuple) else (p, block_n) for p in plan_batches]
    tasks += [(plan_name(b, n), ("plan", b, n)) for b, n in plans]
    scratch = Path(tempfile.mkdtemp(prefix="mla_backend_compile_"))
    jobs = []
    for i, (name, spec) in enumerate(tasks):
        # Into the package: a private cache per task, so its entries are exactly that task's. Otherwise the
        # user's cache, where entries other variants share are compiled once.
        cache_dir = str(scratch / str(i)) if into_package else str(_tilelang_cache_dir())
        jobs.append((name, spec, cache_dir))
    seconds, keys_of = {}, {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=ctx) as pool:
        futures = [pool.submit(_compile_into, job) for job in jobs]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            name, keys, sec = future.result()
            seconds[name], keys_of[name] = sec, keys
            if progress is not None:
                progress(done, len(jobs), name, sec)
    if into_package:
        _pack_release(tasks, keys_of, scratch, fresh)
    shutil.rmtree(scratch, ignore_errors=True)
    return seconds


def _pack_release(tasks: list[tuple], keys_of: dict, scratch: Path, fresh: bool) -> None:
    """Copies each task's entries from its private cache (``scratch/<i>``) into the release folder and writes the
    manifest: this build's variants over the ones the folder held (unless ``fresh``), unreferenced entries removed."""
    root = release_dir()
    old = _Manifest(root).data
    # Every task's private cache has the same layout: the first names the namespace this TileLang seeds into.
    cache_subdir = str(_entries_dir(scratch / "0").relative_to(scratch / "0")) if tasks else old and old["cache_subdir"]
    # Entries of another cache namespace (another platform's build) cannot be seeded into this one's: start over.
    kept = {} if fresh or old is None or old.get("cache_subdir") != cache_subdir else old["variants"]
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    (root / "entries").mkdir(parents=True, exist_ok=True)
    for i, (name, _spec) in enumerate(tasks):
        src_root = _entries_dir(scratch / str(i))
        for key in keys_of[name]:
            dest = root / "entries" / key
            if not dest.exists():
                shutil.copytree(src_root / key, dest)
    variants = {**kept, **keys_of}
    used = {key for keys in variants.values() for key in keys}
    for entry in (root / "entries").iterdir():
        if entry.name not in used:
            shutil.rmtree(entry)
    manifest = {"tilelang": installed_tilelang(), "arch": "sm90", "target": "sm_90a", "cache_subdir": cache_subdir,
                "variants": variants}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
