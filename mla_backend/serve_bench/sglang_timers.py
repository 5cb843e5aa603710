"""serve-bench's host timers in SGLang's scheduler processes: every attention backend's per-step metadata build and
per-layer decode call, read through ``Engine.get_server_info()``.

SGLang runs its model in scheduler subprocesses that return nothing to the engine's caller but their internal state.
Under ``MLA_BACKEND_HOST_TIMERS=1`` each scheduler process (sglang_runner.scheduler_process) wraps, in every
``AttentionBackend`` subclass, ours and the built-ins alike, the methods that run on the host once per step and once per
layer, and adds its timings to the dict its ``Scheduler.get_internal_state`` returns. ``get_server_info()`` gathers
that dict from each scheduler that answers it (one per data-parallel rank), and each read starts the next interval.
"""

from __future__ import annotations

from ..host_trace import TIMING, timed
from .thread_cpu import ThreadCpu, process_timings

#: Host range around each step's metadata build: ``init_forward_metadata`` (eager steps) and
#: ``init_forward_metadata_out_graph`` (the host part before a CUDA-graph replay), the outermost call only.
METADATA_RANGE = "sglang.metadata_build"
#: Host range around each layer's ``forward_decode``. Decode batches that fit a CUDA graph run it inside the graph,
#: so only eager decode steps (batches above the largest graph, or graphs off) time it.
DECODE_CALL_RANGE = "sglang.decode_call"
#: Method name -> range, wrapped in every backend class that defines the method.
TIMED_METHODS = {"init_forward_metadata": METADATA_RANGE, "init_forward_metadata_out_graph": METADATA_RANGE,
                 "forward_decode": DECODE_CALL_RANGE}
#: The key of a scheduler's internal state that holds its timings.
INTERNAL_STATE_KEY = "mla_backend_host_timings"

#: This process's per-thread CPU time, read with the timings (made when the timers are turned on).
_THREAD_CPU: ThreadCpu | None = None


def time_class(cls) -> None:
    """Wrap each of ``TIMED_METHODS`` that ``cls`` itself defines (a subclass's override calling its base's method
    counts once: host_trace times the outermost call of a range)."""
    for method, range_name in TIMED_METHODS.items():
        if method in vars(cls):
            setattr(cls, method, timed(vars(cls)[method], range_name))


def _subclasses(cls) -> list:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def time_attention_backends() -> bool:
    """Under ``MLA_BACKEND_HOST_TIMERS=1``: time every ``AttentionBackend`` subclass defined so far and every one
    defined later (SGLang imports a backend's module when it builds it), and report the timings in
    ``Scheduler.get_internal_state``. Returns whether the timers are on."""
    if not TIMING:
        return False
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.scheduler import Scheduler

    from ..sglang_plugin.backend import parallel_value

    global _THREAD_CPU
    if getattr(AttentionBackend, "mla_backend_timed", False):
        return True
    _THREAD_CPU = ThreadCpu()
    for cls in [AttentionBackend, *_subclasses(AttentionBackend)]:
        time_class(cls)

    def init_subclass_timed(cls, **kwargs):
        super(AttentionBackend, cls).__init_subclass__(**kwargs)
        time_class(cls)

    AttentionBackend.__init_subclass__ = classmethod(init_subclass_timed)
    AttentionBackend.mla_backend_timed = True

    get_internal_state = Scheduler.get_internal_state

    def get_internal_state_timed(self, recv_req):
        output = get_internal_state(self, recv_req)
        state = getattr(output, "internal_state", None)
        if isinstance(state, dict):
            rank = parallel_value("tp_rank", getattr(self, "tp_rank", None))
            state[INTERNAL_STATE_KEY] = process_timings(rank, _THREAD_CPU)
        return output

    Scheduler.get_internal_state = get_internal_state_timed
    return True


def read_host_timings(server_info: dict) -> list[dict]:
    """Each answering scheduler's timings from ``Engine.get_server_info()``'s ``internal_states``."""
    states = server_info.get("internal_states") or []
    return [state[INTERNAL_STATE_KEY] for state in states
            if isinstance(state, dict) and INTERNAL_STATE_KEY in state]
