"""serve-bench's extension of every vLLM worker (``worker_extension_cls``): the scaled random weights, the fp32
verification report and the host timers, in each tensor-parallel worker however the workers start.

vLLM finds a load format in a registry of the process that loads the model. Its tensor-parallel workers may be
spawned, so a registration made in the benchmark's process does not reach them. Every worker imports the class named
in ``worker_extension_cls`` before it loads the model, so naming :class:`WorkerExtension` there runs this module's
registration of the scaled weights (random_weights.py) in each of them, and, with the host timers on, the timing of
every MLA backend's per-step metadata build and per-layer decode call. vLLM mixes the class into its worker, which
makes its methods callable on every rank through ``LLM.collective_rpc``. Import it nowhere else: the import loads
vLLM's model loaders. ``random_weights.vllm_worker_kwargs`` names it for an engine.
"""

from __future__ import annotations

import functools

from ..host_trace import TIMING, timed

from .random_weights import register_vllm_scaled_loader
from .thread_cpu import ThreadCpu, process_timings

#: Host range around vLLM's whole per-step MLA metadata build (``MLACommonMetadataBuilder.build``): the common part and
#: the backend's ``_build_decode``, for ours and every built-in alike.
METADATA_BUILD_RANGE = "vllm.metadata_build"
#: Host range around each layer's decode call (the backend impl's ``forward_mqa``), ours and every built-in alike. It
#: runs only where attention runs outside a CUDA graph (mixed prefill-decode steps under PIECEWISE graphs, eager mode).
DECODE_CALL_RANGE = "vllm.decode_call"


def time_mla_backend_calls() -> bool:
    """Under ``MLA_BACKEND_HOST_TIMERS=1``, time vLLM's ``MLACommonMetadataBuilder.build`` (METADATA_BUILD_RANGE) and
    every MLA backend's ``forward_mqa`` (DECODE_CALL_RANGE). Every MLA builder (CUSTOM, FLASHMLA, FLASH_ATTN_MLA,
    TRITON_MLA) inherits that ``build``, so the timers compare their per-step host time in the same engine conditions,
    which a microbenchmark's hot loop does not reproduce. Each backend's impl defines its own ``forward_mqa``, so
    ``MLACommonBaseImpl.__init__``, which every impl runs, wraps its class's method when the first layer is built.
    Returns whether the timers are on."""
    if not TIMING:
        return False
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl, MLACommonMetadataBuilder

    MLACommonMetadataBuilder.build = timed(MLACommonMetadataBuilder.build, METADATA_BUILD_RANGE)
    init = MLACommonBaseImpl.__init__
    if not getattr(init, "mla_backend_timed", False):
        @functools.wraps(init)
        def init_timing_decode_calls(self, *args, **kwargs):
            cls = type(self)
            cls.forward_mqa = timed(cls.forward_mqa, DECODE_CALL_RANGE)
            init(self, *args, **kwargs)

        init_timing_decode_calls.mla_backend_timed = True
        MLACommonBaseImpl.__init__ = init_timing_decode_calls
    return True


register_vllm_scaled_loader()
time_mla_backend_calls()
#: This worker process's per-thread CPU time, read with the host timers (one interval per workload).
_THREAD_CPU = ThreadCpu() if TIMING else None

#: ``LLM.collective_rpc`` names of :meth:`WorkerExtension.mla_backend_verification` and
#: :meth:`WorkerExtension.mla_backend_host_timings`.
VERIFICATION_RPC = "mla_backend_verification"
HOST_TIMINGS_RPC = "mla_backend_host_timings"


class WorkerExtension:
    """Mixed into each vLLM worker; every attribute is prefixed so that none shadows the worker's own."""

    def mla_backend_verification(self) -> dict | None:
        """This rank's ``MLA_BACKEND_VERIFY=1`` counters (calls, worst relative and LSE error), None while off."""
        from mla_backend.verify import verification_report

        report = verification_report()
        return None if report is None else dict(report, rank=getattr(self, "rank", None))

    def mla_backend_host_timings(self, reset: bool = True) -> dict | None:
        """This rank's host timers (``MLA_BACKEND_HOST_TIMERS=1``, host_trace.py) and its process's per-thread CPU
        time (thread_cpu.py) since the last reset, None while off; ``reset`` starts the next interval."""
        return process_timings(getattr(self, "rank", None), _THREAD_CPU, reset)
