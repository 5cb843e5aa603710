"""Compile-once, cache-on-disk loading and launching of the TileLang decode kernels.

A variant is keyed by (num_heads, q_len, page_size, dtype, kv_dtype, arch); batch, pages and lengths
are runtime values, so an engine compiles each variant once (``warmup``) before graph capture.
TileLang's own disk cache (``TILELANG_CACHE_DIR``, default ``~/.tilelang/cache``) makes later
processes load the binary instead of recompiling.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import prebuilt
from .combine import use_tiled_combine, use_wide_combine
from .configs import KernelConfig, compat_pass_configs, config_for, target_for_arch

logger = logging.getLogger("mla_backend")

_TORCH_TO_TL = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "float8_e4m3",
                torch.float8_e4m3fnuz: "float8_e4m3fnuz"}


@dataclass
class CompileStats:
    compiled: int = 0
    seconds: float = 0.0
    variants: tuple = ()


class Kernels(NamedTuple):
    """The compiled kernels of one variant: the split kernel and its combines (``pick_combine`` picks one)."""

    split: Any
    combine: Any  # one program per (request, row)
    combine_wide: Any  # per (request, row, 128 dims): short batches with many parts per request
    combine_tiled: Any  # per (request, COMBINE_TILE_ROWS rows) side by side: large batches (sm90 only, else None)


def pick_combine(kernels: "Kernels", batch: int, rows: int, num_parts: int):
    """The combine kernel ``mla_decode`` launches after ``kernels.split`` for ``batch`` requests of ``rows`` (heads x
    q_len) rows under a plan of ``num_parts`` parts: the wide one for a short batch with many parts per request, the
    tiled one for a large batch (sm90), else one program per row."""
    if use_wide_combine(batch, rows, num_parts):
        return kernels.combine_wide
    if kernels.combine_tiled is not None and use_tiled_combine(batch, rows):
        return kernels.combine_tiled
    return kernels.combine


# TileLang releases whose JITKernel call is, for kernels without outputs it allocates, a plain positional pass-through
# to the tvm-ffi function ``main`` of the compiled module (jit/adapter/tvm_ffi.py). From 0.1.12 the adapter also picks
# a module per device (and 0.1.15 converts ROCm fp8 arguments), so their kernels are called as objects.
DIRECT_ENTRY_TILELANG = ("0.1.9", "0.1.11")


def launch_entry(kernel, num_args: int):
    """What a launch calls: the compiled module's tvm-ffi function, or ``kernel`` itself.

    A TileLang 0.1.9 / 0.1.11 kernel call rebuilds its argument list in Python (a loop over the parameters, a list
    membership test each) and resolves the module's entry (an FFI lookup per call for a freshly compiled module)
    before it calls that function; the function itself converts the torch tensors, takes torch's current stream and
    checks every argument's dtype, shape and device. The function is returned where the kernel runs through tvm-ffi,
    allocates no output and takes ``num_args`` arguments; anything else (another release or execution backend) keeps
    the kernel object.

    The function keeps the GIL while it launches, as torch's own ops do. tvm-ffi releases it by default
    (``TVM_FFI_RELEASE_GIL_BY_DEFAULT``); a launch returns in microseconds, but a released GIL lets another Python
    thread of the engine (vLLM's engine-core IO threads) take it, and the launching thread then waits for that thread
    to give it back in the middle of a step.
    """
    import tilelang
    from tilelang import tvm

    adapter = getattr(kernel, "adapter", None)
    if (tilelang.__version__.split("+")[0] not in DIRECT_ENTRY_TILELANG
            or getattr(kernel, "execution_backend", None) != "tvm_ffi" or adapter is None or adapter.result_idx
            or len(adapter.params) != num_args):
        return kernel
    module = adapter.executable
    if isinstance(module, tvm.runtime.Executable):
        module = module.jit()
    function = module.get_function("main")
    if hasattr(type(function), "release_gil"):
        function.release_gil = False
    return function


def launch_entries(kernels: Kernels) -> Kernels:
    """``kernels`` with each kernel replaced by its :func:`launch_entry` (split: 17 arguments, combines: 7)."""
    combine = lambda k: None if k is None else launch_entry(k, 7)  # noqa: E731
    return Kernels(launch_entry(kernels.split, 17), combine(kernels.combine), combine(kernels.combine_wide),
                   combine(kernels.combine_tiled))


STATS = CompileStats()
_KERNELS: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


def tl_dtype(dtype: torch.dtype) -> str:
    return _TORCH_TO_TL[dtype]


def torch_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _variant_key(variant: tuple, cfg: KernelConfig | None = None) -> tuple:
    """``(num_heads, q_len, page_size, dtype, kv_dtype, arch)`` plus its tile config: ``cfg``, else the one of
    ``config_for(arch, fp8_compute)`` for a variant that carries ``fp8_compute`` as a 7th element."""
    shape, fp8_compute = variant[:6], len(variant) > 6 and bool(variant[6])
    return (*shape, cfg if cfg is not None else config_for(shape[5], fp8_compute))


def get_kernels(num_heads: int, q_len: int, page_size: int, dtype: torch.dtype, kv_dtype: torch.dtype, arch: str,
                cfg: KernelConfig | None = None):
    """Returns the compiled :class:`Kernels` of one variant, compiling on first use.

    The tile config (and so the kernel source) is ``cfg``, by default ``config_for(arch)``; plans must use its
    ``block_n``. ``config_for(arch, fp8_compute=True)`` selects the e4m3-compute kernel of an fp8 cache.
    """
    key = _variant_key((num_heads, q_len, page_size, dtype, kv_dtype, arch), cfg)
    cfg = key[-1]
    kernels = _KERNELS.get(key)
    if kernels is not None:
        return kernels
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        import tilelang
        from tilelang import tvm

        from . import combine as comb
        from . import portable, sm90

        # The wheel's compiled kernels (prebuilt.py) land in TileLang's cache first, so the compiles below load them.
        shipped = arch == "sm90" and prebuilt.seed(prebuilt.variant_name(
            num_heads, q_len, page_size, torch_name(dtype), torch_name(kv_dtype), cfg.fp8_compute))
        if not shipped:
            logger.info("mla_backend: kernel h=%d q_len=%d page=%d %s/%s %s is not among the prebuilt kernels: "
                        "TileLang compiles it (nvcc) or loads it from its disk cache", num_heads, q_len, page_size,
                        dtype, kv_dtype, arch)
        build_decode_kernel = (sm90 if cfg.kernel == "tws" else portable).build_decode_kernel
        build_combine_kernel = comb.build_combine_kernel
        target = tvm.target.Target(target_for_arch(arch))
        pass_configs = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True, **compat_pass_configs()}
        start = time.perf_counter()
        split = tilelang.compile(
            build_decode_kernel(num_heads, q_len, page_size, tl_dtype(dtype), tl_dtype(kv_dtype), cfg),
            target=target, pass_configs=pass_configs)
        combine, combine_wide = (
            tilelang.compile(build_combine_kernel(num_heads, q_len, tl_dtype(dtype), wide=wide, pdl=cfg.pdl),
                             target=target, pass_configs=pass_configs)
            for wide in (False, True))
        combine_tiled = (tilelang.compile(comb.build_tiled_combine_kernel(
            num_heads, q_len, tl_dtype(dtype), chunks=comb.tiled_combine_chunks(num_heads * q_len),
            pdl=cfg.pdl),
            target=target, pass_configs=pass_configs) if arch == "sm90" else None)
        seconds = time.perf_counter() - start
        STATS.compiled += 1
        STATS.seconds += seconds
        STATS.variants += (key,)
        # A disk-cache hit takes well under a second; a real compile takes several.
        source = "prebuilt" if shipped else ("disk cache hit" if seconds < 1.5 else "compiled")
        logger.info("mla_backend: kernel h=%d q_len=%d page=%d %s/%s %s (%s%s) ready in %.2fs (%s)", num_heads,
                    q_len, page_size, dtype, kv_dtype, arch, cfg.kernel, ", e4m3 compute" if cfg.fp8_compute else "",
                    seconds, source)
        _KERNELS[key] = kernels = Kernels(split, combine, combine_wide, combine_tiled)
        return kernels


def _compile_one(variant: tuple) -> float:
    start = time.perf_counter()
    get_kernels(*variant[:6], cfg=_variant_key(variant)[-1])
    return time.perf_counter() - start


def warmup(variants: list[tuple], workers: int = 1) -> float:
    """Compile ``(num_heads, q_len, page_size, dtype, kv_dtype, arch[, fp8_compute])`` variants before serving.

    With ``workers > 1`` the variants compile in parallel subprocesses that fill TileLang's disk cache,
    then this process loads them from it. Returns the wall time in seconds.
    """
    start = time.perf_counter()
    todo = [v for v in dict.fromkeys(variants) if _variant_key(v) not in _KERNELS]
    if workers > 1 and len(todo) > 1:
        import concurrent.futures
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        try:
            with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx) as pool:
                list(pool.map(_compile_one, todo))
        except Exception as exc:  # noqa: BLE001 - the pool only pre-fills the disk cache
            # Seen with TileLang 0.1.11: a spawned worker dies (BrokenProcessPool). Compile here instead.
            logger.warning("mla_backend: parallel kernel compile failed (%s: %s); compiling serially",
                           type(exc).__name__, exc)
    for variant in todo:
        _compile_one(variant)
    seconds = time.perf_counter() - start
    logger.info("mla_backend: %d kernel variant(s) ready in %.1fs", len(dict.fromkeys(variants)), seconds)
    return seconds
