"""Named host-time ranges: in torch.profiler traces, and in host timers that cost nothing unless turned on.

The plugins wrap their per-step metadata build and their per-layer decode call in :func:`host_range`, so that a
profiled engine run (vLLM's ``--profiler-config``, SGLang's ``/start_profile``, ``serve-bench --profile-steps``)
shows their host time per call by name. A profiler adds its own cost to every op it records, so with
``MLA_BACKEND_HOST_TIMERS=1`` (read at import) each range also keeps ``perf_counter`` times outside any profiler:
:func:`host_timings` gives their p50 / p99 per name (``serve-bench`` reads them per workload from every rank).
With neither, a call costs one check of torch's profiler state and one of a module flag, and allocates nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import torch

#: Prefix of every range name (``mla_backend.<engine>.<what>``): what a trace reader selects on.
PREFIX = "mla_backend."
ENV_HOST_TIMERS = "MLA_BACKEND_HOST_TIMERS"
TIMING = os.environ.get(ENV_HOST_TIMERS) == "1"
#: Most calls a timer keeps between two reads (a read may reset them); later calls are counted, not kept.
MAX_SAMPLES = 1 << 16
_NO_RANGE = contextlib.nullcontext()


class _Timer:
    """One name's durations (ns), reused for every call of its range. A range entered again inside itself (an
    engine method that calls its base class's timed method) counts once, for the outermost call."""

    __slots__ = ("samples", "dropped", "_start", "_depth")

    def __init__(self):
        self.samples: list[int] = []
        self.dropped = 0
        self._start = 0
        self._depth = 0

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._start = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return False
        elapsed = time.perf_counter_ns() - self._start
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(elapsed)
        else:
            self.dropped += 1
        return False


_TIMERS: dict[str, _Timer] = {}


def host_range(name: str):
    """``torch.profiler.record_function(PREFIX + name)`` while a torch profiler records; else, under
    ``MLA_BACKEND_HOST_TIMERS=1``, the name's timer; else a shared no-op."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    if TIMING:
        timer = _TIMERS.get(name)
        if timer is None:
            timer = _TIMERS[name] = _Timer()
        return timer
    return _NO_RANGE


def timed(function, range_name: str):
    """``function`` wrapped in ``host_range(range_name)``, marked so that it is wrapped once (serve-bench times the
    engines' own methods with it, every backend alike)."""
    if getattr(function, "mla_backend_timed", False):
        return function

    @functools.wraps(function)
    def timed_function(*args, **kwargs):
        with host_range(range_name):
            return function(*args, **kwargs)

    timed_function.mla_backend_timed = True
    return timed_function


def host_timings(reset: bool = False) -> dict[str, dict] | None:
    """Per range name (``PREFIX`` + name): calls and p50 / p99 / max microseconds since the last reset; None while
    the timers are off. ``reset`` starts the next interval (serve-bench reads one per workload)."""
    if not TIMING:
        return None
    result = {}
    for name, timer in sorted(_TIMERS.items()):
        if timer.samples:
            result[PREFIX + name] = call_percentiles([ns / 1e3 for ns in timer.samples], dropped=timer.dropped)
        if reset:
            timer.samples, timer.dropped = [], 0
    return result


def call_percentiles(durations_us: list[float], dropped: int = 0) -> dict:
    """``calls`` (the durations and ``dropped`` calls that were counted but not kept) and nearest-rank p50 / p99 /
    max of ``durations_us`` (not empty), in µs to 0.1: the timing record of one range, in traces and timers alike."""
    values = sorted(durations_us)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731 - nearest rank
    return {"calls": len(values) + dropped, "p50_us": round(pick(0.5), 1), "p99_us": round(pick(0.99), 1),
            "max_us": round(values[-1], 1)}


__all__ = ["ENV_HOST_TIMERS", "PREFIX", "call_percentiles", "host_range", "host_timings", "timed"]
