"""Picks the fastest implementation available for a device and problem, and says why."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import torch

from .constants import MAX_HEADS, MAX_Q_LEN, SUPPORTED_PAGE_SIZES
from .kernels.configs import fp8_compute_applies

logger = logging.getLogger("mla_backend")

REFERENCE = "reference"
TILELANG_SM90 = "tilelang-sm90"
TILELANG_GFX942 = "tilelang-gfx942"
IMPLS = ("auto", REFERENCE, TILELANG_SM90, TILELANG_GFX942)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# The fp8 cache each architecture's kernel reads: its hardware's e4m3. Hopper's is OCP e4m3fn (what CUDA engines
# store); MI300X's is e4m3fnuz (exponent bias 8, 0x80 the only NaN), which gfx942 converts natively
# (v_cvt_f32_fp8) and which vLLM and SGLang store on gfx942. A byte read as e4m3fnuz is half its e4m3fn value, so
# neither kernel takes the other's format.
FP8_KV_DTYPES = {"sm90": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz}


# What the engine plugins ask the op for (both engines read it at startup).
ENV_IMPL = "MLA_BACKEND_IMPL"
_LEGACY_ENV_IMPL = "MLA_BACKEND_SGLANG_IMPL"  # the SGLang plugin's earlier name, still honoured


# Whether the engine plugins run an fp8 cache on e4m3 tensor cores (q quantised per (token, head) row, as the engines'
# built-in FlashMLA fp8 paths quantise q): "1" (default) or "0" (q kept in 16 bits, the cache converted). On by
# default: from 32 heads it is 1.08-1.28x our bf16 kernel where the converting one is 0.81-1.04x, and its error is
# FlashMLA fp8's (vLLM's own fp8 MLA backend on Hopper): the same in-engine agreement with TRITON_MLA fp8 as FLASHMLA
# fp8 has (benchmarks/RESULTS.md sections 5 and 7). "0" buys about 10x smaller error for that speed.
ENV_FP8_COMPUTE = "MLA_BACKEND_FP8_COMPUTE"


def engine_fp8_compute() -> bool:
    """``$MLA_BACKEND_FP8_COMPUTE`` (default "1"), the plugins' ``fp8_compute`` for an fp8 cache."""
    value = os.environ.get(ENV_FP8_COMPUTE, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_FP8_COMPUTE}={value!r} is not supported: 1 (default) runs an fp8 cache on e4m3 tensor "
                         "cores with q quantised per (token, head) where heads x q_len > 16, 0 keeps q in 16 bits "
                         "and converts the cache")
    return value == "1"


def engine_impl_request() -> str:
    """``$MLA_BACKEND_IMPL`` (default "auto"): e.g. "tilelang-gfx942" opts an engine into the MI300X kernel."""
    value = os.environ.get(ENV_IMPL) or os.environ.get(_LEGACY_ENV_IMPL) or "auto"
    if value not in IMPLS:
        raise ValueError(f"{ENV_IMPL}={value!r} is not supported; expected one of {IMPLS}")
    return value


@dataclass(frozen=True)
class Choice:
    impl: str
    reason: str


@functools.lru_cache(maxsize=None)
def device_arch(device: torch.device) -> tuple[str | None, str]:
    """``("sm90" | "gfx942" | None, why)`` for a device."""
    if device.type != "cuda":
        return None, f"no GPU kernel for device type '{device.type}'"
    if not torch.cuda.is_available():
        return None, "torch reports no usable GPU"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "").split(":")[0]
        return ("gfx942", arch) if arch == "gfx942" else (None, f"AMD {arch} has no kernel config (gfx942 only)")
    if props.major == 9:
        return "sm90", f"{props.name} (sm_{props.major}{props.minor})"
    return None, f"{props.name} is sm_{props.major}{props.minor}; the TileLang kernels target sm_90 (Hopper)"


@functools.lru_cache(maxsize=None)
def tilelang_available() -> bool:
    return importlib.util.find_spec("tilelang") is not None


def kernel_unsupported(dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, q_len: int | None,
                       page_size: int) -> str | None:
    """Why the kernels cannot run this problem, or None when they can."""
    if dtype not in KERNEL_DTYPES:
        return f"q dtype {dtype} (kernels take float16/bfloat16)"
    if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES.values():
        return (f"kv_cache dtype {kv_dtype} with q {dtype} (kernels take the q dtype, float8_e4m3fn on sm90 or "
                "float8_e4m3fnuz on gfx942)")
    if not 1 <= num_heads <= MAX_HEADS:
        return f"num_heads={num_heads} (kernels take 1..{MAX_HEADS})"
    if q_len is None or not 1 <= q_len <= MAX_Q_LEN:
        return f"q_len={q_len} (kernels take a uniform 1..{MAX_Q_LEN} queries per request)"
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"page_size={page_size} (kernels take {', '.join(map(str, SUPPORTED_PAGE_SIZES))})"
    return None


def fp8_kv_unsupported(arch: str, kv_dtype: torch.dtype) -> str:
    """Why the ``arch`` kernel refuses an fp8 cache of another e4m3 flavour than its own (``FP8_KV_DTYPES``)."""
    want = str(FP8_KV_DTYPES[arch]).removeprefix("torch.")
    if arch == "gfx942":
        return (f"kv_cache.dtype={kv_dtype} on gfx942: the gfx942 kernel takes a float8_e4m3fnuz cache (MI300X's "
                "fp8, as vLLM and SGLang store it there) or the q dtype; an e4m3fn (OCP) cache would be read as "
                "e4m3fnuz (values halved, -0 as NaN): convert it, or use the reference (impl='reference')")
    return (f"kv_cache.dtype={kv_dtype} on {arch}: the {arch} kernel takes a {want} cache or the q dtype; convert it, "
            "or use the reference (impl='reference')")


def select_impl(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int,
                q_len: int | None, page_size: int, requested: str = "auto") -> Choice:
    """Resolve ``requested`` ("auto" or an impl name) to an implementation; raise if an explicit one can't run."""
    if requested not in IMPLS:
        raise ValueError(f"mla_decode: impl={requested!r} is not supported; expected one of {IMPLS}")
    if requested == REFERENCE:
        return Choice(REFERENCE, "requested")
    arch, why = device_arch(device)
    problem = kernel_unsupported(dtype, kv_dtype, num_heads, q_len, page_size)
    if arch is not None and not tilelang_available():
        arch, why = None, "tilelang is not installed"
    if problem is None and arch is not None and kv_dtype != dtype and kv_dtype != FP8_KV_DTYPES[arch]:
        problem = fp8_kv_unsupported(arch, kv_dtype)
    if arch is None or problem is not None:
        reason = why if arch is None else f"unsupported {problem}"
        if requested != "auto":
            raise ValueError(f"mla_decode: impl={requested!r} cannot run here: {reason}")
        return Choice(REFERENCE, reason)
    impl = TILELANG_SM90 if arch == "sm90" else TILELANG_GFX942
    if impl == TILELANG_GFX942 and requested == "auto":
        # Lowered for gfx942 in CI but never run on an MI300X: opt in explicitly (docs/amd.md).
        return Choice(REFERENCE, f"{why}: the gfx942 kernel is unverified on hardware; pass impl={impl!r} to use it")
    if requested not in ("auto", impl):
        raise ValueError(f"mla_decode: impl={requested!r} cannot run on {why}; use {impl!r}")
    return Choice(impl, why)


_LOGGED: set = set()


def log_choice(choice: Choice, key: tuple) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("mla_backend: using %s for %s (%s)", choice.impl, key, choice.reason)


@dataclass(frozen=True)
class Warmup:
    """What :func:`warmup` made ready: the kernel variants ``(num_heads, q_len, page_size, dtype, kv_dtype, arch,
    fp8_compute)``,
    the planner kernel variants, and the wall time."""

    variants: tuple
    plan_variants: int
    seconds: float


def kernel_variants(device: torch.device, num_heads: int, q_lens, page_size: int, dtype: torch.dtype,
                    kv_dtype: torch.dtype, impl: str = "auto", strict: bool = True,
                    fp8_compute: bool = False) -> list[tuple]:
    """The kernel variants ``(num_heads, q_len, page_size, dtype, kv_dtype, arch, fp8_compute)`` ``mla_decode``
    launches for these shapes on ``device``: per q_len, ``select_impl``, its arch and whether ``fp8_compute``
    applies. Where a q_len would run the reference, ``strict`` raises (an engine cannot graph-capture it); otherwise
    that q_len is left out."""
    variants = []
    for q_len in q_lens:
        choice = select_impl(device, dtype, kv_dtype, num_heads, q_len, page_size, impl)
        if choice.impl == REFERENCE:
            if strict and impl != REFERENCE:
                raise RuntimeError(f"mla_backend: no TileLang kernel for heads={num_heads} q_len={q_len} "
                                   f"page={page_size} {dtype}/{kv_dtype} on {device}: {choice.reason}")
            continue
        arch = choice.impl.split("-", 1)[1]
        variants.append((num_heads, q_len, page_size, dtype, kv_dtype, arch,
                         fp8_compute and fp8_compute_applies(arch, num_heads, q_len, kv_dtype != dtype)))
    return variants


def warmup(device: torch.device | str, num_heads: int | None = None, q_lens=(1,), page_size: int | None = None,
           dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None, *, impl: str = "auto",
           max_batch: int = 0, workers: int = 1, strict: bool = True, shapes=(), fp8_compute: bool = False) -> Warmup:
    """Compile (or load from TileLang's disk cache) every kernel ``mla_decode`` launches for these shapes, before an
    engine captures CUDA graphs: select the implementation per q_len, then compile its split and combine kernels
    and, with ``max_batch``, the one-launch planner for plans of up to ``max_batch`` requests.

    ``impl``, ``fp8_compute``: as ``mla_decode``'s (an engine passes ``engine_impl_request()`` and
    ``engine_fp8_compute()``); ``kv_dtype`` defaults to ``dtype``.
    ``shapes``: more ``(num_heads, q_len, page_size, dtype, kv_dtype)`` to warm in the same pass (a benchmark's grid).
    ``workers > 1`` compiles in parallel processes (not from a daemonic process). ``strict``: raise where a shape would
    run the reference on a GPU, else leave it out. A no-op off GPU.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return Warmup((), 0, 0.0)
    start = time.perf_counter()
    todo = list(shapes)
    if num_heads is not None:
        todo = [(num_heads, q_len, page_size, dtype, kv_dtype or dtype) for q_len in q_lens] + todo
    variants = []
    for h, q_len, page, dt, kvd in todo:
        variants += kernel_variants(device, h, (q_len,), page, dt, kvd, impl, strict, fp8_compute)
    variants = list(dict.fromkeys(variants))
    if variants:
        from .kernels import runtime

        runtime.warmup(variants, workers=workers)
    plan_variants = 0
    if max_batch:
        from .planner import warm_up_plan_kernels

        plan_variants = warm_up_plan_kernels(device, max_batch)
    seconds = time.perf_counter() - start
    logger.info("mla_backend: %d kernel variant(s) and %d planner variant(s) ready in %.1fs", len(variants),
                plan_variants, seconds)
    return Warmup(tuple(variants), plan_variants, seconds)
