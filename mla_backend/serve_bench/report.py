"""serve-bench's outputs: one JSON with every raw repeat, a markdown report and a plot.

The markdown has the setup (GPUs, tensor and attention data parallelism, heads per GPU, MTP, KV-cache dtype), one
table per metric with a row per workload and a column per backend (median [min-max] of the repeats), plus the speedup
of ours over the best built-in backend, the attention share of a decode step per cell, and every backend that did
not run, with the reason.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from .. import installed
from . import agreement, verification
from .model_config import parameter_counts
from .profile_trace import HOST_PROBE_CALL, HOST_PROBE_OP
from .weight_memory import GIB, weight_bytes_per_gpu
from .workloads import DECODE

BASENAME = "serve_bench"
VERSIONED_PACKAGES = ("torch", "vllm", "sglang", "sgl-kernel", "tilelang", "flashinfer-python", "triton",
                      "transformers", "mla-backend")
# (key in a workload record, table title, digits, True where a smaller value is better)
METRICS = (
    ("tpot_ms", "TPOT, ms per output token", 2, True),
    ("output_tok_per_s", "Output tokens per second", 0, False),
    ("ttft_ms", "TTFT, ms (throughput: all prompts; mixed: the long prompts)", 0, True),
)


# ----------------------------------------------------------------------------- environment
def _first_line_of(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - not every machine has nvidia-smi or git
        return None
    return out.splitlines()[0].strip() if out else None


def gpu_description() -> dict:
    """GPU name, memory and driver from nvidia-smi, which (unlike torch) creates no CUDA context in this process: the
    engines started after it get the whole GPU."""
    line = _first_line_of(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if line and line.count(",") >= 2:
        name, memory, driver = (part.strip() for part in line.split(",")[:3])
        return {"gpu": name, "gpu_memory": memory, "driver": driver}
    return {"driver": None}


def environment(argv: list[str], engine: str) -> dict:
    """Date, the exact command, versions, GPU and driver."""
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": "mla-backend serve-bench " + " ".join(argv), "engine": engine,
           "python": platform.python_version(), "host": platform.node()}
    for dist in VERSIONED_PACKAGES:
        env[dist] = installed.version(dist)
    try:
        import torch

        env["cuda_runtime"] = torch.version.cuda
    except ImportError:
        pass
    env.update(gpu_description())
    env["git"] = _first_line_of(["git", "-C", os.path.dirname(__file__), "describe", "--always", "--dirty"])
    return env


def run_settings(run) -> dict:
    """What a run measured and how (everything but the backends' results and the wall time)."""
    args, config, options = run.args, run.model_config, run.parallel
    return {"engine": run.engine.name, "backends": list(run.backends), "ours": run.engine.ours,
            "model": args.model, "heads": config["num_attention_heads"], "layers": config["num_hidden_layers"],
            "gpus": options.tensor_parallel_size, "tensor_parallel_size": options.tensor_parallel_size,
            "dp_attention": options.dp_attention,
            "attention_data_parallel_size": options.attention_data_parallel_size,
            "heads_per_gpu": options.heads_per_gpu(config["num_attention_heads"]),
            "speculative_tokens": options.speculative_tokens,
            "decode_context_parallel_size": options.decode_context_parallel_size,
            "weight_gib_per_gpu": round(sum(weight_bytes_per_gpu(config, options.layout).values()) / GIB, 2),
            "kv_cache_dtype": run.kv_cache_dtype,
            "page_size": run.engine.page_size, "init": args.init, "verify": args.verify, "prefix_caching": False,
            "gpu_memory_fraction": args.gpu_memory_fraction, "max_model_len": run.max_model_len,
            "max_num_seqs": run.max_num_seqs, "plan": dataclasses.asdict(run.plan), "budget_s": args.budget,
            "workloads": [w.name for w in run.workloads],
            "workload_kinds": {w.name: w.kind for w in run.workloads},
            # only where several: reports of one engine per backend compare equal under --resume either way
            **({"rounds": args.rounds} if args.rounds > 1 else {})}


def assemble(env: dict, run, results: dict[str, dict], wall_s: float) -> dict:
    """The whole report as one JSON-able dict (every raw repeat is inside ``backends``; a backend kept from an
    earlier run by ``--resume`` carries that run's date, command and commit under ``from_run``)."""
    for result in results.values():  # engines report their versions; fill what the metadata did not have
        for key in ("vllm", "sglang"):
            version = (result.get("engine_info") or {}).get(key)
            if version and not env.get(key):
                env[key] = version
    settings = dict(run_settings(run), backends=list(results), wall_s=round(wall_s, 1))
    return {"env": env, "settings": settings,
            "model": {"config": run.model_config, "parameters": parameter_counts(run.model_config)},
            "backends": results}


def anything_measured(data: dict) -> bool:
    return any(w.get("status") == "ok" for r in data["backends"].values() for w in r.get("workloads", []))


# ----------------------------------------------------------------------------- tables
def format_summary(summary: dict | None, digits: int) -> str:
    """``median [min-max]``, or a dash."""
    if not summary:
        return "–"
    f = f"{{:.{digits}f}}"
    return f"{f.format(summary['median'])} [{f.format(summary['min'])}-{f.format(summary['max'])}]"


def workload_names(data: dict) -> list[str]:
    """Workloads in run order (as the settings list them)."""
    return list(data["settings"]["workloads"])


def records_by_workload(result: dict) -> dict[str, dict]:
    return {w["workload"]: w for w in result.get("workloads", [])}


def cell(record: dict | None, key: str, digits: int) -> str:
    if record is None:
        return "–"
    if record.get("status") == "skipped":
        return "skipped"
    if record.get("status") == "error":
        return "error"
    return format_summary(record.get(key), digits)


def speedup_of_ours(data: dict, workload: str, key: str, smaller_is_better: bool) -> str:
    """Ours over the best built-in backend on the medians (above 1: ours is faster), and which one that is."""
    ours = data["settings"]["ours"]
    medians = {}
    for backend, result in data["backends"].items():
        record = records_by_workload(result).get(workload)
        if record and record.get("status") == "ok" and record.get(key):
            medians[backend] = record[key]["median"]
    best = best_built_in(medians, ours, smaller_is_better)
    if ours not in medians or best is None:
        return "–"
    ratio = medians[best] / medians[ours] if smaller_is_better else medians[ours] / medians[best]
    return f"{ratio:.2f} ({best})"


def best_built_in(values: dict, ours: str, smaller_is_better: bool = True) -> str | None:
    """The backend other than ours with the best of ``values`` ({backend: value}), or None where there is none."""
    others = {b: v for b, v in values.items() if b != ours}
    return (min if smaller_is_better else max)(others, key=others.get) if others else None


def metric_table(data: dict, key: str, title: str, digits: int, smaller_is_better: bool) -> list[str]:
    backends = list(data["backends"])
    rows = []
    for workload in workload_names(data):
        cells = [cell(records_by_workload(data["backends"][b]).get(workload), key, digits) for b in backends]
        if all(c in ("–", "skipped", "error") for c in cells):
            continue
        speedup = speedup_of_ours(data, workload, key, smaller_is_better)
        rows.append(f"| {workload} | " + " | ".join(cells) + f" | {speedup} |")
    if not rows:
        return []
    return [f"#### {title}, median [min-max]", "",
            "| workload | " + " | ".join(backends) + " | ours vs best built-in |",
            "|---" * (len(backends) + 2) + "|", *rows, ""]


def engine_rounds_table(data: dict) -> list[str]:
    """Each engine process's median of every workload (``--rounds``, rounds.py): TPOT where the workload has it, else
    output tokens per second; engines in their start order."""
    if data["settings"].get("rounds", 1) < 2:
        return []
    backends = list(data["backends"])
    rows = []
    for workload in workload_names(data):
        records = [records_by_workload(data["backends"][b]).get(workload) or {} for b in backends]
        key = next((k for k in ("tpot_ms", "output_tok_per_s") if any(_engine_medians(r, k) for r in records)), None)
        if key is None:
            continue
        digits = 2 if key == "tpot_ms" else 0
        per_engine = [_engine_medians(r, key) for r in records]
        cells = [", ".join("–" if v is None else f"{v:.{digits}f}" for v in values) or "–" for values in per_engine]
        rows.append(f"| {workload} | {key} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    missing = [f"- {b}: {why}" for b in backends for why in data["backends"][b].get("rounds_skipped", [])]
    return [f"#### Each engine process's median ({data['settings'].get('rounds', 1)} rounds, the order reversed every "
            "other round)", "", "| workload | metric | " + " | ".join(backends) + " |",
            "|---" * (len(backends) + 2) + "|", *rows, "", *(["Engines not measured:", *missing, ""] if missing else []),
            "The tables above pool every engine's repeats; profiles and host timers are the first round's engines'.",
            ""]


def _engine_medians(record: dict, key: str) -> list:
    """Each engine's median of ``key`` in a workload record: the pooled list, or the one engine's median where a
    backend's later rounds did not run."""
    if "engine_medians" in record:
        return record["engine_medians"].get(key, [])
    value = record.get(key)
    return [value["median"]] if isinstance(value, dict) and value.get("median") is not None else []


def attention_share_table(data: dict) -> list[str]:
    backends = list(data["backends"])
    rows = []
    for workload in workload_names(data):
        shares = []
        for b in backends:
            record = records_by_workload(data["backends"][b]).get(workload) or {}
            profile = record.get("profile") or {}
            share = profile.get("attention_share")
            per_step = profile.get("attention_us_per_step")
            communication = profile.get("communication_us_per_step")
            brackets = ([f"{per_step:.0f} µs"] if per_step else []) + (
                [f"communication {communication:.0f} µs"] if communication else [])
            shares.append("–" if share is None else f"{share:.0%}" + (f" ({'; '.join(brackets)})" if brackets else ""))
        if any(s != "–" for s in shares):
            rows.append(f"| {workload} | " + " | ".join(shares) + " |")
    if not rows:
        return []
    plan = data["settings"]["plan"]
    return [f"#### Attention share of a profiled step's GPU kernel time (torch.profiler, {plan['profile_steps']} "
            "steps; attention kernel µs per step in brackets)", "",
            "| workload | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|", *rows, "",
            "A decode cell's steps follow its timed windows; the mixed load's follow its first long prompt's arrival "
            "in an untimed pass (its prefill chunks among the decode steps). "
            "Communication: the collectives' kernels per step, where the engine runs on several GPUs. A one-shot "
            "all-reduce spins until every rank arrives, so its time is mostly the wait for the slowest rank's host. "
            "On several GPUs each writes a trace; the one with the most attention time is shown.", ""]


# A decode cell whose TPOT is within this factor of its profiled steps' GPU kernel time was paced by the GPU; above it
# the engine's host loop (its Python, scheduling, sampling) set TPOT, and engine processes of one backend have differed
# by up to 1.4x there (benchmarks/RESULTS.md, section 9).
GPU_PACED_MAX_RATIO = 1.05


def decode_pace(record: dict | None) -> tuple[float, float] | None:
    """(TPOT median, GPU kernel time per profiled step), both in ms, of a measured decode cell, or None."""
    if not record or record.get("status") != "ok" or record.get("kind") != DECODE:
        return None
    kernel_us = (record.get("profile") or {}).get("kernel_us_per_step")
    tpot_ms = (record.get("tpot_ms") or {}).get("median")
    return (tpot_ms, kernel_us / 1000) if kernel_us and tpot_ms else None


def paced_by(tpot_ms: float, kernel_ms: float) -> str:
    return "GPU" if tpot_ms <= GPU_PACED_MAX_RATIO * kernel_ms else "host"


def pace_table(data: dict) -> list[str]:
    """Per decode cell and backend, the GPU kernel time of a profiled step against TPOT and which of the two set the
    pace; then the best built-in's GPU time per step over ours. Not with MTP, where a step yields 1 + accepted tokens
    and TPOT is not a step's time."""
    if data["settings"].get("speculative_tokens"):
        return []
    backends, ours = list(data["backends"]), data["settings"]["ours"]
    rows = []
    for workload in workload_names(data):
        paces = {b: decode_pace(records_by_workload(data["backends"][b]).get(workload)) for b in backends}
        if not any(paces.values()):
            continue
        cells = ["–" if p is None else f"{p[1]:.2f} / {p[0]:.2f} ({paced_by(*p)})" for p in paces.values()]
        kernel_ms = {b: p[1] for b, p in paces.items() if p}
        best = best_built_in(kernel_ms, ours)
        ratio = f"{kernel_ms[best] / kernel_ms[ours]:.2f} ({best})" if ours in kernel_ms and best else "–"
        rows.append(f"| {workload} | " + " | ".join(cells) + f" | {ratio} |")
    if not rows:
        return []
    return ["#### What paced each decode cell: GPU kernel time of a profiled step / TPOT, ms", "",
            "| workload | " + " | ".join(backends) + " | ours vs best built-in, GPU time per step |",
            "|---" * (len(backends) + 2) + "|", *rows, "",
            f"GPU: TPOT within {GPU_PACED_MAX_RATIO - 1:.0%} of the step's GPU kernel time. host: above it, so the "
            "engine's host loop set TPOT, and there TPOT compares engine processes more than backends (`--rounds` "
            "starts several engines per backend in turn). Last column: the least GPU time per step among the "
            "built-ins over ours (above 1: ours spends less).", ""]


def _range_table(data: dict, title: str, ranges_of, footer: str) -> list[str]:
    """A table of per-call host times (p50 / p99 (calls)) by workload and range name, one column per backend;
    ``ranges_of(record)`` gives a workload record's {range name: timing}."""
    backends = list(data["backends"])
    rows = []
    for workload in workload_names(data):
        per_backend = [ranges_of(records_by_workload(data["backends"][b]).get(workload) or {}) for b in backends]
        for name in sorted(set().union(*per_backend)):
            cells = [f"{t[name]['p50_us']:.1f} / {t[name]['p99_us']:.1f} ({t[name]['calls']})" if name in t else "–"
                     for t in per_backend]
            rows.append(f"| {workload} | `{name}` | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [f"#### {title}", "", "| workload | range | " + " | ".join(backends) + " |",
            "|---" * (len(backends) + 2) + "|", *rows, "", footer, ""]


def host_table(data: dict) -> list[str]:
    """Host time per call of the named ranges in the profiled steps (profile_trace.host_ranges), per backend."""
    return _range_table(data, "Host time per call in the profiled steps, µs p50 / p99 (calls)",
                        lambda record: (record.get("profile") or {}).get("host") or {},
                        f"`{HOST_PROBE_OP}`: a torch op the engine's own step code calls alike for every backend; its "
                        "time shows how fast that engine's host ran, which sets a host-bound step's TPOT.")


def workload_records(data: dict):
    """``(workload, backend, record)`` for every workload in report order and every backend; ``{}`` where that backend
    has no record of it."""
    for workload in workload_names(data):
        for backend, result in data["backends"].items():
            yield workload, backend, records_by_workload(result).get(workload) or {}


def host_children_table(data: dict) -> list[str]:
    """Where our host ranges' time goes in the profiled steps (profile_trace.range_children): one row per workload,
    backend and range, its heaviest direct children in µs per call."""
    rows = []
    for workload, backend, record in workload_records(data):
        for name, r in ((record.get("profile") or {}).get("host_children") or {}).items():
            children = ", ".join(f"`{child}` {us:.1f}" for child, us in r["children"].items())
            rows.append(f"| {workload} | {backend} | `{name}` | {r['us_per_call']:.1f} ({r['calls']}) | {children} |")
    if not rows:
        return []
    return ["#### Inside our host ranges in the profiled steps, µs per call", "",
            "| workload | backend | range | µs per call (calls) | heaviest direct children, µs per call |",
            "|---|---|---|---|---|", *rows, "",
            "Host events of the same thread inside each range (torch ops, CUDA runtime calls), not inside another of "
            "them; `(self)`: the time no child covers (Python). The profiler inflates every op.", ""]


def host_step_table(data: dict) -> list[str]:
    """The busiest host thread's profiled step (profile_trace.host_step_ops): per workload and backend, its busy µs
    per step and the heaviest top-level events."""
    rows = []
    for workload, backend, record in workload_records(data):
        step = (record.get("profile") or {}).get("host_step") or {}
        if step:
            ops = ", ".join(f"`{name}` {us:.0f}" for name, us in step["ops"].items())
            probe = f"{step['probe_us']:.1f}" if step.get("probe_us") is not None else "–"
            rows.append(f"| {workload} | {backend} | {step['busy_us_per_step']:.0f} | {step['events_per_step']:.0f} | "
                        f"{probe} | {ops} |")
    if not rows:
        return []
    return ["#### The busiest host thread in the profiled steps, µs per step", "",
            f"| workload | backend | in events | events | `{HOST_PROBE_CALL}` µs | heaviest top-level events |",
            "|---|---|---|---|---|---|", *rows,
            "", "Top-level host events of the thread with the most (torch ops, CUDA runtime calls, annotated ranges "
            "inside no other event), summed per step; a host-bound step's time beyond them is plain Python. The "
            f"profiler inflates every op. `{HOST_PROBE_CALL}`: that thread's median call, a probe of how fast its "
            "process ran (the engine's own eager launches, alike for every backend).", ""]


def worst_rank_timings(ranks: list[dict]) -> dict[str, dict]:
    """Per range, the largest p50 and p99 over the ranks and their calls together (a step waits for its slowest
    rank)."""
    merged: dict[str, dict] = {}
    for rank in ranks:
        for name, t in rank.get("ranges", {}).items():
            m = merged.setdefault(name, {"calls": 0, "p50_us": 0.0, "p99_us": 0.0})
            m["calls"] += t["calls"]
            m["p50_us"], m["p99_us"] = max(m["p50_us"], t["p50_us"]), max(m["p99_us"], t["p99_us"])
    return merged


#: What the host timers' engine-wide ranges time, per engine (the footer of host_timer_table).
HOST_TIMER_RANGES = {
    "vllm": "`mla_backend.vllm.metadata_build`: vLLM's whole per-step MLA metadata build, the same method for every "
            "backend (ours includes `mla_backend.vllm.build_decode`); `mla_backend.vllm.decode_call`: each layer's "
            "`forward_mqa`, every backend alike (ours includes `mla_backend.vllm.forward_mqa`). Under FULL CUDA "
            "graphs the per-layer call runs inside the graph: only mixed prefill-decode steps (PIECEWISE) time it.",
    "sglang": "`mla_backend.sglang.metadata_build`: each backend's own `init_forward_metadata` (eager steps) or "
              "`init_forward_metadata_out_graph` (before a decode graph's replay; ours includes "
              "`mla_backend.sglang.build_decode`); `mla_backend.sglang.decode_call`: each layer's `forward_decode` "
              "outside a graph.",
}


def host_timer_table(data: dict) -> list[str]:
    """Host time per call of our ranges without a profiler (host_trace's timers, read per workload on every rank)."""
    engine = (data.get("settings") or {}).get("engine")
    return _range_table(data, "Host time per call without a profiler, µs p50 / p99 (calls), slowest rank",
                        lambda record: worst_rank_timings(record.get("host_timers") or []),
                        "`perf_counter` around each call (`MLA_BACKEND_HOST_TIMERS=1`, which serve-bench sets), over "
                        "the whole workload, profiled steps excepted. " + HOST_TIMER_RANGES.get(engine, ""))


def _where_cell(where: dict | None, sharing: list) -> str:
    """The main thread's CPU at the interval's end (thread_cpu.cpu_facts), and the ranks whose main thread was on the
    same physical core."""
    if not where or where.get("cpu") is None:
        return "–"
    facts = [f"{where['mhz']} MHz" if where.get("mhz") is not None else None,
             f"node {where['numa_node']}" if where.get("numa_node") is not None else None,
             f"core {where['smt_siblings']}" if where.get("smt_siblings") else None]
    cell = f"{where['cpu']} ({', '.join(f for f in facts if f)})" if any(facts) else str(where["cpu"])
    return cell + (f"; **shares its core with rank {', '.join(map(str, sharing))}**" if sharing else "")


def _physical_core(threads: dict):
    """The physical core a rank's main thread ended on: its SMT siblings list, else its CPU id (None where unknown)."""
    where = threads.get("main_cpu") or {}
    return where.get("smt_siblings") or where.get("cpu")


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{100 * share:.1f}%"


def thread_cpu_table(data: dict) -> list[str]:
    """Per workload, backend and rank: the engine process's main thread's CPU share and forced context switches, the
    share it waited runnable for a CPU, the virtual machine's steal over all CPUs, where the main thread ran, and its
    other threads that were busy (thread_cpu.py; read with the host timers)."""
    rows = []
    for workload, backend, record in workload_records(data):
        ranks = [r for r in record.get("host_timers") or [] if r.get("threads")]
        cores = {r.get("rank"): _physical_core(r["threads"]) for r in ranks}
        for rank in ranks:
            threads = rank["threads"]
            main = [t for t in threads["threads"] if t["main"]]
            others = ", ".join(f"`{t['name']}` {100 * t['share']:.0f}%" for t in threads["threads"] if not t["main"])
            main_cell = (f"{100 * main[0]['share']:.0f}% ({main[0]['involuntary']})" if main else "–")
            queued = _percent(main[0].get("runqueue_share")) if main else "–"
            own = cores[rank.get("rank")]
            sharing = [other for other, core in cores.items()
                       if other != rank.get("rank") and own is not None and core == own]
            rows.append(f"| {workload} | {backend} | {rank.get('rank')} | {threads['wall_s']} | {main_cell} | "
                        f"{queued} | {_percent(threads.get('steal'))} | "
                        f"{_where_cell(threads.get('main_cpu'), sharing)} | {others or '–'} |")
    if not rows:
        return []
    return ["#### Engine process threads: CPU time over each workload", "",
            "| workload | backend | rank | wall s | main thread CPU (forced context switches) "
            "| main thread runnable, waiting for a CPU | stolen by the hypervisor, all CPUs "
            "| main thread's CPU at the end (clock, NUMA node, SMT siblings) | other busy threads, CPU |",
            "|---|---|---|---|---|---|---|---|---|", *rows, "",
            "From `/proc` (user + system time per thread over the workload's wall time, the profiled steps included). "
            "A host-bound step runs at its main thread's speed: forced switches mean the kernel took its CPU away, and "
            "the time it waited runnable says for how long; the rest of its time off the CPU it slept (waiting on "
            "another process, rank or the GPU). A busy thread beside it shares the process's interpreter lock and the "
            "cores. On a virtual machine the hypervisor's steal slows every thread without showing in its counters. "
            "Where the main thread ran is read once, at the workload's end (a thread may move); two ranks' main "
            "threads on one physical core (SMT siblings) each run slower.", ""]


#: Engine-table note for a measured engine that filled a compile cache at its start (``--cold-start measure``;
#: vllm_runner.compile_cache_counts, sglang_runner.compile_cache_dirs).
COLD_START_NOTE = ("filled a compile cache at start: in our runs such an engine's host loop ran slower afterwards, "
                   "so compare its host-bound cells (small batches) only with care")


def _caches(roots) -> str:
    return f" ({', '.join(f'`{r}`' for r in roots)})" if roots else ""


def engine_table(data: dict) -> list[str]:
    lines = ["#### Engines", "", "| backend | status | start s | KV-cache tokens | prefill chunk | notes |",
             "|---|---|---|---|---|---|"]
    for backend, result in data["backends"].items():
        info = result.get("engine_info") or {}
        notes = [result.get("reason") or ""]
        earlier = result.get("from_run")
        if earlier:
            kept_rounds = result.get("kept_rounds")
            what = f"its first {kept_rounds} engine(s) kept" if kept_rounds else "kept"
            notes.append(f"{what} from the run of {earlier.get('date')} (commit {earlier.get('git')}): "
                         f"`{earlier.get('command')}`")
        if info.get("compiled_at_start"):
            notes.append(COLD_START_NOTE + _caches(info.get("grown_caches")))
        if info.get("cold_start_s") is not None:
            notes.append(f"measured on its second start: the first ({info['cold_start_s']} s) filled a compile cache"
                         + _caches(info.get("cold_start_caches")))
        ran = str(info.get("attention_backend") or "")
        if ran and not ran.lower().endswith(backend.lower()):  # an engine may swap a backend it cannot run
            notes.append(f"the engine reports attention backend {ran}")
        draft = info.get("draft_attention_backend", backend)  # absent without MTP; None: vLLM chose it
        if draft != backend:
            notes.append(f"its MTP layer's attention ran on {draft or 'a backend vLLM chose'}")
        skipped = [f"{w['workload']}: {w.get('reason') or w.get('error')}" for w in result.get("workloads", [])
                   if w.get("status") in ("skipped", "error")]
        notes += skipped
        lines.append(f"| {backend} | {result.get('status')} | {info.get('start_s', '–')} | "
                     f"{info.get('kv_capacity_tokens', '–')} | {info.get('prefill_chunk_tokens', '–')} | "
                     + "; ".join(n for n in notes if n).replace("|", "/") + " |")
    return lines + [""]


def setup_table(data: dict) -> list[str]:
    """One row: how the model was spread over the GPUs and what each GPU's attention ran."""
    s = data["settings"]
    mtp = f"{s.get('speculative_tokens', 0)} draft tokens" if s.get("speculative_tokens") else "off"
    return ["| GPUs | TP | attention DP | heads per GPU | MTP | KV cache | decode CP | weights per GPU |",
            "|---|---|---|---|---|---|---|---|",
            f"| {s.get('gpus', 1)} | {s.get('tensor_parallel_size', 1)} | {s.get('attention_data_parallel_size', 1)} "
            f"| {s.get('heads_per_gpu', s['heads'])} | {mtp} | {s['kv_cache_dtype']} | "
            f"{s.get('decode_context_parallel_size', 1)} | {s.get('weight_gib_per_gpu', '–')} GiB |", ""]


def weight_description(config: dict) -> str:
    quant = config.get("quantization_config")
    if not quant:
        return "bf16"
    return f"{quant['quant_method']} {'x'.join(map(str, quant['weight_block_size']))}-block weights"


def header(data: dict) -> list[str]:
    env, s, config = data["env"], data["settings"], data["model"]["config"]
    params = sum(data["model"]["parameters"].values())
    engine_version = env.get(s["engine"])
    return [f"### serve-bench: {s['engine']} {engine_version} on {env.get('gpu')} ({env['date'][:10]})", "",
            f"Model: DeepSeek-V3 attention (hidden {config['hidden_size']}, q_lora {config['q_lora_rank']}, kv_lora "
            f"{config['kv_lora_rank']}, rope {config['qk_rope_head_dim']}, yarn) with {s['heads']} heads, "
            f"{s['layers']} layers, MoE {config['n_routed_experts']} experts x {config['moe_intermediate_size']} "
            f"(top {config['num_experts_per_tok']}), vocabulary {config['vocab_size']}, {params / 1e9:.2f} B "
            f"parameters, {weight_description(config)}, {s['init']} weights. "
            f"KV cache {s['kv_cache_dtype']}, page {s['page_size']}, prefix caching off, {s['plan']['repeats']} "
            f"repeats (decode: windows of {s['plan']['window_steps']} steps on one prefilled batch)."
            + (" Every engine eager, ours checked against the fp32 reference (`--verify`): eager speeds, not served "
               "ones." if s.get("verify") else ""), "",
            f"torch {env.get('torch')} (CUDA {env.get('cuda_runtime')}), vLLM {env.get('vllm')}, SGLang "
            f"{env.get('sglang')}, TileLang {env.get('tilelang')}, FlashInfer {env.get('flashinfer-python')}, "
            f"driver {env.get('driver')}, commit {env.get('git')}. Run took {s['wall_s']:.0f} s.", "",
            f"Command: `{env['command']}`", "", *setup_table(data)]


def markdown(data: dict) -> str:
    lines = header(data)
    for key, title, digits, smaller in METRICS:
        lines += metric_table(data, key, title, digits, smaller)
    lines += engine_rounds_table(data)
    lines += attention_share_table(data)
    lines += pace_table(data)
    lines += agreement.markdown(data)
    lines += verification.markdown(data)
    lines += host_table(data)
    lines += host_children_table(data)
    lines += host_step_table(data)
    lines += host_timer_table(data)
    lines += thread_cpu_table(data)
    lines += engine_table(data)
    lines += ["Decode cells: TPOT of the whole batch, each repeat a window of decode steps after every request was "
              "prefilled; output tokens per second = batch / TPOT. Throughput: output tokens over the wall time of "
              "one generate call with every prompt. Mixed: decoders' TPOT while long prompts arrive and prefill in "
              "chunks, from the first arrival to the last long prompt's first token. \"ours vs best built-in\": the "
              "best built-in median over ours for times, ours over it for rates (above 1: ours is faster)."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plot
def plot(data: dict, path: str | Path) -> str | None:
    """TPOT per decode cell and output tokens per second of the other workloads, per backend, with min-max bars.
    Returns None when written, else why not (matplotlib missing, nothing measured)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot"
    backends = list(data["backends"])
    panels = [(DECODE, "tpot_ms", "TPOT (ms), decode cells"), (None, "output_tok_per_s", "output tokens/s")]
    series = []
    for kind, key, label in panels:
        names = [w for w in workload_names(data)
                 if any((records_by_workload(data["backends"][b]).get(w) or {}).get(key) for b in backends)
                 and ((kind == DECODE) == (data["settings"]["workload_kinds"].get(w) == DECODE))]
        if names:
            series.append((names, key, label))
    if not series:
        return "no speed was measured (TPOT, tokens per second); no plot"
    fig, axes = plt.subplots(len(series), 1, figsize=(max(8, 1.1 * max(len(s[0]) for s in series) + 3),
                                                      4.2 * len(series)), squeeze=False)
    for ax, (names, key, label) in zip(axes[:, 0], series):
        measured = [b for b in backends
                    if any((records_by_workload(data["backends"][b]).get(w) or {}).get(key) for w in names)]
        width = 0.8 / len(measured)
        for i, backend in enumerate(measured):
            records = records_by_workload(data["backends"][backend])
            stats = [(records.get(w) or {}).get(key) for w in names]
            xs = [j + (i - (len(measured) - 1) / 2) * width for j in range(len(names))]
            medians = [s["median"] if s else float("nan") for s in stats]
            low = [s["median"] - s["min"] if s else 0 for s in stats]
            high = [s["max"] - s["median"] if s else 0 for s in stats]
            ax.bar(xs, medians, width, yerr=[low, high], capsize=2, label=backend)
        values = [(records_by_workload(data["backends"][b]).get(w) or {}).get(key) for b in measured for w in names]
        medians = [v["median"] for v in values if v]
        if medians and min(medians) > 0 and max(medians) / min(medians) > 20:  # decode cells span decades
            ax.set_yscale("log")
        ax.set_xlim(-0.5, len(names) - 0.5)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    env, s = data["env"], data["settings"]
    parallel = (f"TP{s.get('tensor_parallel_size', 1)}" + (" DP-attn" if s.get("dp_attention") else "")
                + (f" MTP{s['speculative_tokens']}" if s.get("speculative_tokens") else ""))
    axes[0, 0].set_title(f"serve-bench {s['engine']} {env.get(s['engine'])}, {env.get('gpu')}, {parallel}, "
                         f"{s.get('heads_per_gpu', s['heads'])} heads/GPU, {s['layers']} layers, "
                         f"KV {s['kv_cache_dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(out_dir: str | Path, data: dict) -> list[str]:
    """Writes serve_bench.json, serve_bench.md and serve_bench.png (when matplotlib is there); returns the paths."""
    base = Path(out_dir) / BASENAME
    files = []
    base.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    files.append(str(base.with_suffix(".json")))
    base.with_suffix(".md").write_text(markdown(data))
    files.append(str(base.with_suffix(".md")))
    why_not = plot(data, base.with_suffix(".png"))
    if why_not:
        print(f"[serve-bench] {why_not}", file=sys.stderr)
    else:
        files.append(str(base.with_suffix(".png")))
    return files
