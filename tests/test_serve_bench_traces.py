"""CPU tests of serve-bench's trace reader and host timers (mla_backend/serve_bench/profile_trace.py,
mla_backend/host_trace.py, mla_backend/serve_bench/thread_cpu.py): GPU kernel time by category from a torch.profiler
trace, the host ranges and their direct children, the ``perf_counter`` timers outside a profiler (in fresh processes:
they are read at import) and the engine process's per-thread CPU time."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mla_backend.host_trace import host_range
from mla_backend.serve_bench import report
from mla_backend.serve_bench.profile_trace import (categorize, host_ranges, host_step_ops, kernel_breakdown,
                                                  load_trace_events, range_children, traces_since)
from mla_backend.serve_bench.runner_common import EngineSession, read_profile
from mla_backend.serve_bench.thread_cpu import ThreadCpu, cpu_facts, read_cpu_ticks, steal_share
from test_serve_bench import REPORT_ENV, _synthetic_report

def _trace(path: Path, kernels: dict[str, float]) -> Path:
    events = [{"ph": "X", "cat": "kernel", "name": name, "dur": us, "ts": i}
              for i, (name, us) in enumerate(kernels.items())]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 1e6, "ts": 0})  # not GPU time
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_kernel_breakdown_gives_the_attention_share(tmp_path):
    kernels = {"mla_decode_split_kernel": 300.0, "mla_decode_combine_kernel": 50.0, "mla_plan_kernel": 10.0,
               "void flash::flash_fwd_splitkv_mla_kernel<...>": 0.0,
               "concat_and_cache_mla_kernel": 20.0, "fused_moe_kernel": 200.0, "nvjet_hsh_128x256": 300.0,
               "rms_norm_kernel": 120.0,
               # FlashInfer's names, neither of them attention
               "void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<...>": 160.0,
               "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheHeadParallelismKernel<...>": 40.0}
    path = _trace(tmp_path / "w.pt.trace.json.gz", kernels)
    breakdown = kernel_breakdown(load_trace_events(path), steps=4)
    assert breakdown["total_kernel_us"] == 1200.0
    assert breakdown["attention_share"] == pytest.approx(0.3)
    assert breakdown["attention_us_per_step"] == 90.0 and breakdown["kernel_us_per_step"] == 300.0
    assert breakdown["communication_us_per_step"] == 40.0
    assert breakdown["categories"]["kv_cache_write"]["us"] == 20.0 and breakdown["categories"]["rope"]["us"] == 40.0
    assert set(breakdown["categories"]) == {"attention", "communication", "kv_cache_write", "rope", "moe", "gemm",
                                            "norm"}
    assert traces_since(tmp_path, since=0) == [path] and traces_since(tmp_path, since=time.time() + 60) == []


def test_read_profile_reads_every_gpu_s_trace_and_keeps_the_busiest(tmp_path):
    """Under DP attention at batch 1 one GPU holds the request and the others step idle: each backend is read on the
    GPU with the most attention time, whichever trace was written last."""
    busy = _trace(tmp_path / "decode-b1-TP-2-DP-2.trace.json.gz",
                  {"mla_decode_split_kernel": 400.0, "fused_moe_kernel": 1000.0})
    for rank in (0, 1, 3):
        _trace(tmp_path / f"decode-b1-TP-{rank}-DP-{rank}.trace.json.gz",
               {"mla_decode_split_kernel": 8.0, "fused_moe_kernel": 1000.0})
    (tmp_path / "other.txt").write_text("")  # not a trace
    os.utime(busy, (time.time() - 10, time.time() - 10))
    assert traces_since(tmp_path, 0, "decode-b1*.trace.json*")[-1].name != busy.name  # written first
    profile = read_profile(tmp_path, 0, steps=2, pattern="decode-b1*.trace.json*")
    assert profile["trace"] == busy.name and profile["traces_read"] == 4
    assert profile["attention_us_per_step"] == 200.0 and profile["kernel_us_per_step"] == 700.0
    assert "error" in read_profile(tmp_path / "none", 0, steps=2)


def test_a_session_waits_for_one_trace_per_gpu(tmp_path):
    session = EngineSession()
    session.spec = SimpleNamespace(tensor_parallel_size=2)
    _trace(tmp_path / "decode-b1-TP-0.trace.json.gz", {"mla_decode_split_kernel": 8.0})
    assert not session.traces_written(tmp_path, 0, "decode-b1*.trace.json*")
    _trace(tmp_path / "decode-b1-TP-1.trace.json.gz", {"mla_decode_split_kernel": 8.0})
    assert session.traces_written(tmp_path, 0, "decode-b1*.trace.json*")
    assert not session.traces_written(tmp_path, time.time() + 60, "decode-b1*.trace.json*")


def test_host_ranges_read_the_plugins_ranges_from_a_real_profiler_trace(tmp_path):
    """host_range records a named range only under a profiler; host_ranges reads its calls and percentiles back from
    the Chrome trace torch writes, beside the engines' attention op (a cpu_op)."""
    assert host_range("vllm.forward_mqa") is host_range("vllm.build_decode")  # the shared no-op
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            with host_range("vllm.forward_mqa"):
                x = x @ x / 64
        with host_range("vllm.build_decode"):
            y = x[:8]  # aten::slice: the host-speed probe every backend's step code runs
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    events = load_trace_events(path) + [{"ph": "X", "cat": "cpu_op", "name": "vllm::unified_mla_attention_with_output",
                                         "dur": 40.0, "ts": 0}]
    ranges = host_ranges(events)
    assert set(ranges) == {"mla_backend.vllm.forward_mqa", "mla_backend.vllm.build_decode",
                           "vllm::unified_mla_attention_with_output", "aten::slice"} and y.shape == (8, 64)
    forward = ranges["mla_backend.vllm.forward_mqa"]
    assert forward["calls"] == 5 and ranges["mla_backend.vllm.build_decode"]["calls"] == 1
    assert 0 < forward["p50_us"] <= forward["p99_us"] <= forward["max_us"]
    assert ranges["vllm::unified_mla_attention_with_output"]["p50_us"] == 40.0


def test_range_children_split_a_range_into_its_direct_children():
    """Synthetic thread: a range of 100 µs holding A (20 µs, with a nested op of its own) and B (50 µs); another
    thread's op at the same time is not inside it."""
    def event(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    events = [event("mla_backend.vllm.build_decode", 0, 100, "user_annotation"), event("aten::as_strided", 10, 20),
              event("aten::empty", 12, 8), event("cudaLaunchKernelExC", 40, 50, "cuda_runtime"),
              event("aten::mm", 5, 90, tid=2), event("mla_backend.vllm.build_decode", 200, 10, "user_annotation")]
    children = range_children(events)["mla_backend.vllm.build_decode"]
    assert children["calls"] == 2 and children["us_per_call"] == 55.0
    assert children["children"] == {"cudaLaunchKernelExC": 25.0, "aten::as_strided": 10.0, "(self)": 20.0}


def test_host_step_ops_sum_the_busiest_thread_s_top_level_events_per_step():
    """Two steps on thread 1 (a step marker and a Python frame around them count as nothing), a busier-looking nested
    op that is not top-level, and a quieter thread 2."""
    def event(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}
    events = [event("ProfilerStep#3", 0, 1000, "user_annotation"), event("forward", 0, 1000, "python_function"),
              event("aten::copy_", 10, 40), event("aten::copy_", 500, 20), event("cudaGraphLaunch", 60, 100,
                                                                                  "cuda_runtime"),
              event("sglang.metadata_build", 200, 200, "user_annotation"), event("aten::index", 210, 150),
              event("aten::mm", 0, 30, tid=2), event("mla_decode_split", 0, 900, "kernel"),
              # the host-speed probe: every launch of the busiest thread, nested or not; not thread 2's
              event("cudaLaunchKernel", 220, 8, "cuda_runtime"), event("cudaLaunchKernel", 600, 12, "cuda_runtime"),
              event("cudaLaunchKernel", 100, 50, "cuda_runtime", tid=2)]
    step = host_step_ops(events, steps=2, top=2)
    assert step == {"busy_us_per_step": 186.0, "events_per_step": 2.5,
                    "ops": {"sglang.metadata_build": 100.0, "cudaGraphLaunch": 50.0}, "probe_us": 10.0}
    assert host_step_ops([], steps=2) == {}


def test_host_step_ops_read_a_real_profiler_trace(tmp_path):
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            x = torch.matmul(x, x) / 64
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    step = host_step_ops(load_trace_events(path), steps=4)
    assert {"aten::matmul", "aten::div"} <= set(step["ops"]) and "aten::mm" not in step["ops"]  # mm: inside matmul
    assert step["events_per_step"] >= 2 and step["busy_us_per_step"] >= sum(step["ops"].values()) - 0.5


def test_range_children_read_a_real_profiler_trace(tmp_path):
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with host_range("vllm.forward_mqa"):
                x = torch.matmul(x, x) / 64
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    forward = range_children(load_trace_events(path))["mla_backend.vllm.forward_mqa"]
    assert forward["calls"] == 3 and forward["us_per_call"] > 0
    assert "aten::matmul" in forward["children"] and "aten::div" in forward["children"]
    assert "aten::mm" not in forward["children"]  # inside aten::matmul, not a direct child
    assert forward["children"]["(self)"] >= 0
    assert sum(forward["children"].values()) == pytest.approx(forward["us_per_call"], abs=0.5)


HOST_TIMERS_PROCESS = """
import torch
from mla_backend.host_trace import host_range, host_timings
for _ in range(5):
    with host_range("vllm.build_decode"):
        pass
with host_range("vllm.build_decode"):
    with host_range("vllm.build_decode"):  # inside itself (a base class's timed method): counted once
        pass
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
    with host_range("vllm.build_decode"):  # a profiler records it instead of the timer
        pass
first = host_timings(reset=True)
print(first["mla_backend.vllm.build_decode"]["calls"] if first is not None else None, host_timings())
"""


@pytest.mark.parametrize("env,expected", [("1", "6 {}"), ("0", "None None")])
def test_host_timers_time_the_ranges_outside_a_profiler_only_when_turned_on(env, expected):
    done = subprocess.run([sys.executable, "-c", HOST_TIMERS_PROCESS], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MLA_BACKEND_HOST_TIMERS=env, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected


@pytest.mark.parametrize("name,category", [
    ("flash_fwd_splitkv_mla_kernel", "attention"), ("flash::FlashAttnFwdSm90<...>", "attention"),
    ("_fwd_grouped_kernel_stage1", "attention"), ("_fwd_kernel_stage2", "attention"),
    ("BatchMLAPagedAttentionKernel", "attention"), ("create_flashmla_kv_indices_triton", "attention"),
    ("concat_and_cache_mla_kernel", "kv_cache_write"), ("grouped_topk_kernel", "moe"),
    ("sm90_xmma_gemm_bf16bf16", "gemm"), ("act_and_mul_kernel", "other"),
    # FlashInfer's collectives and rope kernels carry its name; neither is attention
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<(flashinfer::"
     "trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 2, true, true>", "communication"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>", "communication"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheHeadParallelismKernel<true, 64u, 8u, 8u, __nv_bfloat16>",
     "rope"),
    # SGLang's norms are FlashInfer's; vLLM's its own
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*)", "norm"),
    ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*)", "norm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm"),
    ("mla_decode_split_kernel", "attention"), ("mla_plan_kernel", "attention"),
    ("smxx::decode::get_mla_metadata_kernel(GetDecodeSchedMetaParams)", "attention")])
def test_kernel_names_fall_in_their_category(name, category):
    assert categorize(name) == category


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread CPU time is read from Linux's /proc")
def test_thread_cpu_names_the_busy_thread_beside_the_main_thread():
    cpu = ThreadCpu()
    done = threading.Event()

    def spin():
        while not done.is_set():
            pass

    busy = threading.Thread(target=spin, name="spinner")
    idle = threading.Thread(target=done.wait, name="sleeper")
    busy.start(), idle.start()
    time.sleep(0.6)
    interval = cpu.interval()  # while both live: a thread that ended has left /proc
    done.set()
    busy.join(), idle.join()
    threads = interval["threads"]
    assert threads[0]["main"] and threads[0]["tid"] == os.getpid()
    names = [t["name"] for t in threads[1:]]
    assert "spinner" in names and "sleeper" not in names, threads
    spinner = threads[1 + names.index("spinner")]
    assert spinner["cpu_s"] >= 0.2 and spinner["share"] >= 0.2 and interval["wall_s"] >= 0.6  # ticks: coarse
    assert all(t["tid"] != spinner["tid"] for t in cpu.interval()["threads"])  # the next interval starts afresh


def test_report_gives_each_rank_s_main_thread_and_its_busy_threads():
    data = _synthetic_report()
    data["backends"]["CUSTOM"]["workloads"][0]["host_timers"] = [
        {"rank": 0, "ranges": {}, "threads": {"wall_s": 12.5, "threads": [
            {"tid": 7, "name": "VLLM::EngineCore", "main": True, "cpu_s": 11.9, "share": 0.952, "involuntary": 3},
            {"tid": 9, "name": "output_thread", "main": False, "cpu_s": 4.1, "share": 0.328, "involuntary": 0}]}}]
    text = report.markdown(data)
    assert "#### Engine process threads: CPU time over each workload" in text
    # no run-queue time, steal or CPU facts (a kernel without schedstat, not a virtual machine, older reports): dashes
    assert "| decode b16 8k | CUSTOM | 0 | 12.5 | 95% (3) | – | – | – | `output_thread` 33% |" in text


def test_report_says_where_each_rank_s_main_thread_ran_and_flags_a_shared_core():
    data = _synthetic_report()

    def rank(n, cpu, siblings, mhz):
        return {"rank": n, "ranges": {}, "threads": {
            "wall_s": 3.3, "allowed_cpus": 32, "steal": 0.004, "threads": [
                {"tid": 7 + n, "name": "MainThread", "main": True, "cpu_s": 2.6, "share": 0.8, "involuntary": 4,
                 "runqueue_share": 0.012}],
            "main_cpu": {"cpu": cpu, "mhz": mhz, "numa_node": 0, "smt_siblings": siblings}}}

    workloads = data["backends"]["CUSTOM"]["workloads"]
    workloads[0]["host_timers"] = [rank(0, 3, "3,19", 3100), rank(1, 19, "3,19", 2000)]
    text = report.markdown(data)
    assert ("| decode b16 8k | CUSTOM | 0 | 3.3 | 80% (4) | 1.2% | 0.4% | 3 (3100 MHz, node 0, core 3,19); "
            "**shares its core with rank 1** | – |") in text
    assert ("| 1 | 3.3 | 80% (4) | 1.2% | 0.4% | 19 (2000 MHz, node 0, core 3,19); **shares its core with rank 0** "
            "| – |") in text
    workloads[0]["host_timers"] = [rank(0, 3, "3,19", 3100), rank(1, 4, "4,20", None)]
    text = report.markdown(data)
    assert "| 3 (3100 MHz, node 0, core 3,19) | – |" in text and "| 4 (node 0, core 4,20) | – |" in text
    assert "shares its core" not in text


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/schedstat")
                    or not hasattr(os, "sched_setaffinity"), reason="run-queue time is read from /proc's schedstat")
def test_the_interval_says_how_long_the_main_thread_waited_for_its_cpu():
    """The main thread and a busy process pinned to one CPU: the thread waits runnable for a good part of the time
    (CFS shares the CPU about evenly); alone on it, it hardly waits."""
    cpu = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    os.sched_setaffinity(0, {cpu})
    try:
        alone = ThreadCpu()
        spin(0.4)
        alone_share = alone.interval()["threads"][0]["runqueue_share"]
        rival = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 3\n"
                                  "while time.monotonic() < end: pass"])
        try:
            os.sched_setaffinity(rival.pid, {cpu})
            shared = ThreadCpu()
            spin(0.8)
            interval = shared.interval()
        finally:
            rival.kill()
            rival.wait()
    finally:
        os.sched_setaffinity(0, allowed)
    main = interval["threads"][0]
    assert main["main"] and alone_share is not None and alone_share < 0.1, (alone_share, interval)
    assert main["runqueue_share"] > 0.2 and main["share"] < 0.8, interval


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="steal time is read from Linux's /proc/stat")
def test_steal_is_the_hypervisor_s_share_of_all_cpus_time():
    before = read_cpu_ticks()
    time.sleep(0.05)
    after = read_cpu_ticks()
    ticks, stolen = after["total"] - before["total"], after["steal"] - before["steal"]
    assert ticks >= 0 and 0 <= stolen <= ticks
    assert steal_share({"total": 1000, "steal": 10}, {"total": 3000, "steal": 60}) == 0.025
    assert steal_share(None, after) is None and steal_share(after, after) is None
    threads = ThreadCpu()
    time.sleep(0.05)
    steal = threads.interval()["steal"]
    assert steal is None or 0 <= steal <= 1


@pytest.mark.skipif(not os.path.isdir("/sys/devices/system/cpu/cpu0"), reason="CPU topology is read from Linux's /sys")
def test_the_interval_says_which_cpu_the_main_thread_ran_on():
    interval = ThreadCpu().interval()
    where = interval["main_cpu"]
    assert where["cpu"] in os.sched_getaffinity(0) and interval["allowed_cpus"] == len(os.sched_getaffinity(0))
    assert str(where["cpu"]) in where["smt_siblings"].replace("-", ",").split(",") or "-" in where["smt_siblings"]
    assert where["numa_node"] is not None and (where["mhz"] is None or where["mhz"] > 100)
    assert cpu_facts(None) == {"cpu": None, "mhz": None, "numa_node": None, "smt_siblings": None}



def test_markdown_host_step_table_shows_the_busiest_thread_s_step():
    data = _synthetic_report()
    assert "The busiest host thread" not in report.markdown(data)  # no trace read: no table
    data["backends"]["CUSTOM"]["workloads"][0]["profile"]["host_step"] = {
        "busy_us_per_step": 812.4, "events_per_step": 95.0, "ops": {"cudaGraphLaunch": 410.2, "aten::copy_": 88.0},
        "probe_us": 7.93}
    text = report.markdown(data)
    assert "#### The busiest host thread in the profiled steps, µs per step" in text
    assert "| workload | backend | in events | events | `cudaLaunchKernel` µs | heaviest top-level events |" in text
    assert "| decode b16 8k | CUSTOM | 812 | 95 | 7.9 | `cudaGraphLaunch` 410, `aten::copy_` 88 |" in text


def test_the_mixed_load_s_profiled_steps_get_their_own_attention_share_row():
    from mla_backend.serve_bench import driver
    from mla_backend.serve_bench.runner_common import measurement
    from mla_backend.serve_bench.workloads import MixedLoad

    run = driver.resolve(driver.build_parser().parse_args(
        ["--engine", "sglang", "--backends", "tilelang_mla,flashmla", "--workloads", "mixed"]))
    repeats = [{"tpot_ms": v} for v in (20.0, 21.0, 22.0)]
    profiled = {"attention_share": 0.31, "attention_us_per_step": 5120.0, "steps": 5}
    backends = {"tilelang_mla": {"status": "done", "workloads": [measurement(MixedLoad(), repeats, profile=profiled)]},
                "flashmla": {"status": "done", "workloads": [measurement(MixedLoad(), repeats)]}}
    text = report.markdown(report.assemble(dict(REPORT_ENV), run, backends, wall_s=10.0))
    assert "#### Attention share of a profiled step's GPU kernel time" in text
    assert f"| {MixedLoad().name} | 31% (5120 µs) | – |" in text
