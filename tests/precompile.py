"""The TileLang kernels the collected GPU tests launch, compiled in parallel before the first test runs.

Each kernel variant JIT-compiles on first use for 30-80 s, one after another in the test process, so the GPU modules
took well over ten minutes on an empty TileLang cache. tests/conftest.py calls :func:`precompile` once collection is
done: it reads the variants off the selected items and compiles them, one process per variant, into TileLang's disk
cache (``prebuilt.compile_variants``), where the tests then load them.

An item takes part when it is marked ``gpu`` and ``mla_kernels`` (the GPU test modules mark themselves). Its variant
``(heads, q_len, page_size, dtype, kv_dtype)`` (and ``True`` for the e4m3-compute kernel) is :data:`DEFAULTS`, updated
by the ``mla_kernels`` markers' keywords (module, then function) and then by the item's parameters of those names
(``fp8=True`` meaning an e4m3fn cache); ``kv_dtype=None`` is the q dtype, as in the tests' ``make_problem``. A test that
builds other kernels names them in its marker: its variant's fields, and ``plans=`` the planner kernels beyond the one
every decode plans with, as max batches or ``(max_batch, block_n)``.

The ``gpu`` tests on a Hopper GPU report at the end of the run any kernel they launched that was not precompiled (a
variant a test builds that its marker does not declare).
"""

from __future__ import annotations

import os
import time

import torch

FP8 = torch.float8_e4m3fn
DEFAULTS = dict(heads=16, q_len=1, page_size=64, dtype=torch.bfloat16, kv_dtype=None, fp8_compute=False)
# mla_decode without a plan, and every SplitPlanner the tests build for up to 256 requests, plan with the planner
# kernel sized 256 (plan_kernel.scan_size)
DEFAULT_PLAN_BATCH = 256
ENV_SWITCH = "MLA_BACKEND_TEST_PRECOMPILE"


def item_kernels(item) -> tuple[set[tuple], set[tuple]]:
    """``({(heads, q_len, page_size, dtype, kv_dtype)}, {(max_batch, block_n or None)})`` that ``item`` launches;
    empty for items not marked ``gpu`` and ``mla_kernels``."""
    markers = list(item.iter_markers("mla_kernels"))
    if not markers or "gpu" not in item.keywords:
        return set(), set()
    fields, plans = dict(DEFAULTS), {(DEFAULT_PLAN_BATCH, None)}
    for marker in reversed(markers):  # closest last: a function's marker overrides its module's
        kwargs = dict(marker.kwargs)
        plans |= {p if isinstance(p, tuple) else (p, None) for p in kwargs.pop("plans", ())}
        fields.update(kwargs)
    params = getattr(getattr(item, "callspec", None), "params", {})
    fields.update({k: v for k, v in params.items() if k in DEFAULTS})
    if "fp8" in params:
        fields["kv_dtype"] = FP8 if params["fp8"] else None
    variant = (fields["heads"], fields["q_len"], fields["page_size"], fields["dtype"],
               fields["kv_dtype"] or fields["dtype"], *((True,) if fields["fp8_compute"] else ()))
    return {variant}, plans


def collected_kernels(items) -> tuple[list[tuple], list[tuple]]:
    """The variants and planners of all ``items``, de-duplicated and sorted."""
    variants, plans = set(), set()
    for item in items:
        v, p = item_kernels(item)
        variants |= v
        plans |= p
    return sorted(variants, key=str), sorted(plans, key=str)


def _cpus() -> int:
    # the CPUs this process may use (a container's share), not the host's count
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def compile_for_sm90(variants, plans, workers: int | None = None) -> tuple[list[str], float]:
    """Compiles ``variants`` and ``plans`` (as :func:`collected_kernels` gives them) into TileLang's cache for the
    sm90 kernels, one process per variant; variants that run the reference are left out. Returns the names compiled
    (``prebuilt.variant_name`` / ``plan_name``) and the wall time."""
    from mla_backend.dispatch import kernel_unsupported
    from mla_backend.kernels import prebuilt
    from mla_backend.kernels.configs import config_for
    from mla_backend.kernels.plan_kernel import scan_size
    from mla_backend.kernels.runtime import torch_name

    block_n = config_for("sm90").block_n
    # select_impl's rules for sm90: the sizes and dtypes the kernels take, and Hopper's e4m3fn as the fp8 cache
    specs = [(h, q, p, torch_name(dt), torch_name(kv), *c) for h, q, p, dt, kv, *c in variants
             if kernel_unsupported(dt, kv, h, q, p) is None and kv in (dt, FP8)]
    # the planner kernel is keyed by the max batch rounded up to a power of two: one compile per size
    plan_specs = sorted({(scan_size(b), n or block_n) for b, n in plans})
    todo = len(specs) + len(plan_specs)
    if not todo:
        return [], 0.0
    start = time.perf_counter()
    seconds = prebuilt.compile_variants(specs, plan_batches=plan_specs, block_n=block_n,
                                        workers=min(workers or _cpus(), todo))
    return list(seconds), time.perf_counter() - start


def precompile(items, write_line) -> list[str]:
    """Compiles the kernels of the collected ``items`` where they will run (an sm90 GPU, TileLang importable) and
    ``$MLA_BACKEND_TEST_PRECOMPILE`` is not 0; reports one line. Returns the names compiled (none elsewhere)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not torch.cuda.is_available():
        return []
    from mla_backend.dispatch import device_arch, tilelang_available

    variants, plans = collected_kernels(items)
    if not variants or device_arch(torch.device("cuda"))[0] != "sm90" or not tilelang_available():
        return []
    try:
        names, seconds = compile_for_sm90(variants, plans)
    except Exception as exc:  # noqa: BLE001 - only a head start: the tests still compile what they miss
        write_line(f"mla_backend: precompiling the GPU tests' kernels failed ({type(exc).__name__}: {exc}); "
                   "they compile as the tests run")
        return []
    write_line(f"mla_backend: {len(names)} kernel variants and planners compiled or found in TileLang's cache in "
               f"{seconds:.0f}s ({_cpus()} CPUs; {ENV_SWITCH}=0 skips this)")
    return names


def not_precompiled(names) -> list[str]:
    """The kernels this process launched that are not among ``names`` (what :func:`precompile` returned)."""
    from mla_backend.kernels import plan_kernel, prebuilt, runtime

    launched = {prebuilt.variant_name(h, q, p, runtime.torch_name(dt), runtime.torch_name(kv), cfg.fp8_compute)
                for h, q, p, dt, kv, arch, cfg in runtime.STATS.variants if arch == "sm90"}
    launched |= {prebuilt.plan_name(size, block_n) for size, block_n, _pdl in plan_kernel._KERNELS}
    return sorted(launched - set(names))
