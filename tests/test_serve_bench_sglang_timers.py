"""serve-bench's host timers in SGLang's scheduler processes (sglang_timers.py), against SGLang's own classes.

Needs SGLang's package (CI: ``PYTHONPATH=.ci/sglang-site``); each check runs in a fresh process with
``MLA_BACKEND_HOST_TIMERS=1``, because turning the timers on wraps SGLang's classes for the rest of the process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="sglang is not importable (CI: PYTHONPATH=.ci/sglang-site)")

TIMED_PROCESS = r"""
import json, sys, time, types
sys.path.insert(0, "tests")
from sglang_cpu_env import prepare_cpu_torchvision
prepare_cpu_torchvision()
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # defined before the timers
from mla_backend.serve_bench.sglang_timers import read_host_timings, time_attention_backends
assert time_attention_backends() and time_attention_backends()  # a second call wraps nothing twice
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.managers.io_struct import GetInternalStateReqOutput
from sglang.srt.managers.scheduler import Scheduler
from mla_backend.sglang_plugin.backend import TileLangMLABackend


class Probe(AttentionBackend):  # defined after: the subclass hook wraps it
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        time.sleep(0.002)

    def forward_decode(self, *args, **kwargs):
        time.sleep(0.001)


probe = object.__new__(Probe)
for _ in range(4):
    probe.init_forward_metadata(None)  # the base's eager entry calls out_graph inside it: one call each
probe.init_forward_metadata_out_graph(None)  # the host part before a graph replay
for _ in range(3):
    probe.forward_decode()
wrapped = {cls.__name__: sorted(m for m in ("init_forward_metadata", "init_forward_metadata_out_graph",
                                            "forward_decode")
                                if getattr(vars(cls).get(m), "mla_backend_timed", False))
           for cls in (TritonAttnBackend, TileLangMLABackend, Probe)}
# SGLang's scheduler needs a GPU to exist; its get_internal_state runs here on an object that answers the one
# thing it asks for, returning SGLang's own output type.
# The rank comes from SGLang's runtime context, where both 0.5.17 and 0.5.23 keep it (their schedulers have no
# tp_rank attribute).
from sglang.srt.runtime_context import get_parallel
get_parallel().override_permanently(tp_rank=2)
scheduler = types.SimpleNamespace(internal_state=types.SimpleNamespace(
    get_internal_state=lambda req: GetInternalStateReqOutput(internal_state={"last_gen_throughput": 1.0})))
state = Scheduler.get_internal_state(scheduler, None).internal_state
first = read_host_timings({"internal_states": [state]})
again = read_host_timings({"internal_states": [Scheduler.get_internal_state(scheduler, None).internal_state]})
print(json.dumps({"wrapped": wrapped, "first": first, "again": again, "kept": state["last_gen_throughput"]}))
"""


def test_sglang_scheduler_times_every_backend_and_reports_in_its_internal_state():
    done = subprocess.run([sys.executable, "-c", TIMED_PROCESS], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, MLA_BACKEND_HOST_TIMERS="1", PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    everything = ["forward_decode", "init_forward_metadata", "init_forward_metadata_out_graph"]
    assert result["wrapped"]["TileLangMLABackend"] == everything
    assert "init_forward_metadata" in result["wrapped"]["TritonAttnBackend"]
    assert result["wrapped"]["Probe"] == ["forward_decode", "init_forward_metadata_out_graph"]
    (first,), (again,) = result["first"], result["again"]
    assert result["kept"] == 1.0 and first["rank"] == 2 and first["pid"] > 0
    build = first["ranges"]["mla_backend.sglang.metadata_build"]
    call = first["ranges"]["mla_backend.sglang.decode_call"]
    assert build["calls"] == 5 and 2000 <= build["p50_us"] < 2000 + 50_000
    assert call["calls"] == 3 and call["p50_us"] >= 1000
    assert first["threads"]["threads"][0]["main"]
    assert again["ranges"] == {}  # each read starts the next interval


def test_sglang_timers_stay_off_unless_turned_on():
    done = subprocess.run([sys.executable, "-c",
                           "import sys; sys.path.insert(0, 'tests')\n"
                           "from sglang_cpu_env import prepare_cpu_torchvision; prepare_cpu_torchvision()\n"
                           "from mla_backend.serve_bench.sglang_timers import time_attention_backends\n"
                           "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend\n"
                           "print(time_attention_backends(), hasattr(TritonAttnBackend.init_forward_metadata, "
                           "'mla_backend_timed'))"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, MLA_BACKEND_HOST_TIMERS="0", PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False False"
