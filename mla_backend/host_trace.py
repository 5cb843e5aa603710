"""Named host-time ranges for torch.profiler traces, free when no profiler records.

The plugins wrap their per-step metadata build and their per-layer decode call in :func:`host_range`, so that a
profiled engine run (vLLM's ``--profiler-config``, SGLang's ``/start_profile``, ``serve-bench --profile-steps``)
shows their host time per call by name. Outside a profiler a call costs one check of torch's profiler state
(about 0.2 µs) and allocates nothing.
"""

from __future__ import annotations

import contextlib

import torch

#: Prefix of every range name (``mla_backend.<engine>.<what>``): what a trace reader selects on.
PREFIX = "mla_backend."
_NO_RANGE = contextlib.nullcontext()


def host_range(name: str):
    """``torch.profiler.record_function(PREFIX + name)`` while a torch profiler records, else a shared no-op."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return _NO_RANGE


__all__ = ["PREFIX", "host_range"]
