"""Where a decode step's GPU time goes, from a torch.profiler trace (Chrome trace JSON, as both engines write it).

Only GPU kernels count (events of category ``kernel``, CUDA-graph replays included). Each kernel name is put in the
first category whose pattern it matches; the share of ``attention`` (the decode attention kernels of whichever
backend ran, with their planning / metadata and combine kernels, but not the KV-cache write) in the total is the
attention share the report shows. The heaviest kernels of every category are kept, so that the classification can be
checked by reading the names.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from ..host_trace import PREFIX, call_percentiles

# First match wins: the KV-cache write before attention, since its kernel names mention MLA too; collectives, rotary
# embeddings and norms before it too, since FlashInfer's (trtllm all-reduce, BatchQKApplyRotary..., SGLang's
# norm::FusedAddRMSNormKernel) carry its name. A
# one-shot all-reduce spins until its peers arrive, so under tensor parallelism its time is mostly the wait for the
# slowest rank: counted as attention, it would swamp the attention kernels.
CATEGORY_PATTERNS = (
    ("communication", re.compile(r"all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|nccl|lamport|cross_device"
                                 r"|one_?shot|two_?shot", re.I)),
    ("kv_cache_write", re.compile(r"concat_and_cache|reshape_and_cache|set_mla_kv|set_kv_buffer|store_kv", re.I)),
    ("rope", re.compile(r"rotary|(?<![a-z])rope", re.I)),
    ("norm", re.compile(r"rms_?norm|layer_?norm|norm::", re.I)),
    ("attention", re.compile(
        r"mla_decode|mla_plan"  # ours (TileLang: split, combine, planner)
        r"|mla"  # FlashMLA (splitkv_mla, mla_combine, metadata), FlashInfer (BatchMLAPagedAttention), SGLang's indices
        r"|flash_fwd|FlashAttn|flash::|prepare_varlen"  # FlashAttention-3 and its scheduler
        r"|_fwd_grouped_kernel|_fwd_kernel_stage|decode_attention"  # Triton decode attention (vLLM, SGLang)
        r"|flashinfer|BatchDecode|BatchPrefill|merge_state|kv_indices", re.I)),
    ("moe", re.compile(r"moe|expert|topk|top_k|grouped_gemm", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|sm90_|splitk|matmul", re.I)),
)
OTHER = "other"
TOP_KERNELS = 8


def load_trace_events(path: str | Path) -> list[dict]:
    """The events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def categorize(kernel_name: str) -> str:
    for category, pattern in CATEGORY_PATTERNS:
        if pattern.search(kernel_name):
            return category
    return OTHER


def kernel_breakdown(events: list[dict], steps: int | None = None) -> dict:
    """GPU kernel time by category: total microseconds, the attention share, per-category totals and top kernels,
    and, given the number of profiled ``steps``, attention, communication and total microseconds per step."""
    per_kernel: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel" and e.get("ph", "X") == "X":
            per_kernel[e.get("name", "?")] += float(e.get("dur", 0.0))
    categories: dict[str, dict] = {}
    for name, us in per_kernel.items():
        entry = categories.setdefault(categorize(name), {"us": 0.0, "kernels": {}})
        entry["us"] += us
        entry["kernels"][name] = us
    total = sum(per_kernel.values())
    for entry in categories.values():
        top = sorted(entry["kernels"].items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
        entry["kernels"] = {name: round(us, 1) for name, us in top}
        entry["us"] = round(entry["us"], 1)
        entry["share"] = round(entry["us"] / total, 4) if total else None
    attention = categories.get("attention", {}).get("us", 0.0)
    result = {"total_kernel_us": round(total, 1), "attention_share": round(attention / total, 4) if total else None,
              "categories": categories, "kernel_names": len(per_kernel)}
    if steps:
        communication = categories.get("communication", {}).get("us", 0.0)
        result.update(steps=steps, attention_us_per_step=round(attention / steps, 1),
                      communication_us_per_step=round(communication / steps, 1),
                      kernel_us_per_step=round(total / steps, 1))
    return result


# Host ranges: the plugins' own (mla_backend.host_trace: metadata build per step, decode call per layer), the
# engines' attention op, which every backend's layer calls from Python outside FULL CUDA graphs (vLLM's piecewise
# steps), and HOST_PROBE_OP. torch.profiler writes record_function ranges as user_annotation, torch ops as cpu_op.
#: A torch op that the engine's own step code calls alike whatever the backend: its time per call tells how fast this
#: engine process's host ran (engines of one backend have differed 1.8x in it, from where their processes ran), to
#: read a host-bound step's TPOT against.
HOST_PROBE_OP = "aten::slice"
#: The same probe among the CUDA runtime calls, which a trace of GPU activities alone (SGLang's) also holds: every
#: backend's step launches the engine's own eager kernels, and one process ran all of them 1.6x slower than another
#: engine of the same run, `cudaStreamIsCapturing` included (RESULTS.md section 9).
HOST_PROBE_CALL = "cudaLaunchKernel"
HOST_RANGE_PATTERN = re.compile("^" + re.escape(PREFIX) + r"|unified_(mla_)?attention|^" + re.escape(HOST_PROBE_OP) + "$",
                                re.I)
HOST_CATEGORIES = ("user_annotation", "cpu_op")
#: Trace events of GPU work and GPU-side ranges, not of a host thread.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def host_ranges(events: list[dict]) -> dict:
    """Host time of each named range matching :data:`HOST_RANGE_PATTERN`: calls and p50 / p99 / max microseconds."""
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and e.get("ph", "X") == "X" and HOST_RANGE_PATTERN.search(e.get("name", "")):
            durations[e["name"]].append(float(e.get("dur", 0.0)))
    return {name: call_percentiles(values) for name, values in sorted(durations.items())}


#: Children kept per range by :func:`range_children`.
TOP_CHILDREN = 6


def host_events_by_thread(events: list[dict], skip=lambda e: False) -> list[list[dict]]:
    """The complete host events (not GPU work; ``skip(e)`` false) of each thread, each thread's sorted by start, an
    enclosing event before the ones it holds."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph", "X") == "X" and "dur" in e and e.get("cat") not in GPU_CATEGORIES and not skip(e):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
    return list(by_thread.values())


def range_children(events: list[dict], prefix: str = PREFIX, top: int = TOP_CHILDREN) -> dict:
    """Where the host time of each range named ``prefix``* goes: per range name, ``calls``, ``us_per_call`` and its
    heaviest direct children (host events of the same thread inside it, not inside another such child; torch ops,
    CUDA runtime calls) as {name: µs per call}, with ``(self)`` for the time no child covers."""
    totals: dict[str, dict] = {}
    for thread_events in host_events_by_thread(events):
        for i, outer in enumerate(thread_events):
            name = outer.get("name", "")
            if outer.get("cat") != "user_annotation" or not name.startswith(prefix):
                continue
            start, end = float(outer["ts"]), float(outer["ts"]) + float(outer["dur"])
            record = totals.setdefault(name, {"calls": 0, "us": 0.0, "children": defaultdict(float)})
            record["calls"] += 1
            record["us"] += end - start
            covered_to = start
            for inner in thread_events[i + 1:]:
                inner_start = float(inner["ts"])
                if inner_start >= end:
                    break
                if inner_start < covered_to:  # inside a direct child already counted
                    continue
                inner_end = min(end, inner_start + float(inner["dur"]))
                record["children"][inner.get("name", "?")] += inner_end - inner_start
                covered_to = inner_end
    result = {}
    for name, record in sorted(totals.items()):
        calls = record["calls"]
        children = sorted(record["children"].items(), key=lambda kv: -kv[1])
        kept = {child: round(us / calls, 1) for child, us in children[:top]}
        kept["(self)"] = round((record["us"] - sum(record["children"].values())) / calls, 1)
        result[name] = {"calls": calls, "us_per_call": round(record["us"] / calls, 1), "children": kept}
    return result


#: Top-level host events kept per step by :func:`host_step_ops`.
TOP_STEP_OPS = 8
#: Host events that span others without being host work of their own (the profiler's step markers and its own span;
#: under with_stack, Python frames). Events inside them still count as top-level.
TRANSPARENT_CATEGORIES = ("python_function", "Trace")
TRANSPARENT_NAME = re.compile(r"^ProfilerStep#")


def _transparent(event: dict) -> bool:
    return event.get("cat") in TRANSPARENT_CATEGORIES or bool(TRANSPARENT_NAME.match(event.get("name", "")))


def host_step_ops(events: list[dict], steps: int, top: int = TOP_STEP_OPS) -> dict:
    """Where the busiest host thread's time goes in the profiled steps: its top-level events (torch ops, CUDA runtime
    calls, annotated ranges that lie inside no other event of that thread) summed by name, in µs per step, the
    heaviest ``top`` kept, with ``busy_us_per_step`` their total and ``events_per_step``. Plain Python between two
    events is in none of them, so a host-bound step's time beyond ``busy_us_per_step`` is the interpreter's own.
    ``probe_us``: that thread's median :data:`HOST_PROBE_CALL`, how fast its process ran."""
    busiest, busiest_us = None, -1.0
    for thread_events in host_events_by_thread(events, skip=_transparent):
        per_name: dict[str, float] = defaultdict(float)
        covered_to, count = float("-inf"), 0
        for e in thread_events:
            start = float(e["ts"])
            if start < covered_to:  # inside a top-level event already counted
                continue
            per_name[e.get("name", "?")] += float(e["dur"])
            covered_to, count = start + float(e["dur"]), count + 1
        busy = sum(per_name.values())
        if busy > busiest_us:
            busiest, busiest_us = (per_name, count, thread_events), busy
    if busiest is None or steps <= 0:
        return {}
    per_name, count, thread_events = busiest
    probes = [float(e["dur"]) for e in thread_events if e.get("name") == HOST_PROBE_CALL]
    heaviest = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_us_per_step": round(busiest_us / steps, 1), "events_per_step": round(count / steps, 1),
            "ops": {name: round(us / steps, 1) for name, us in heaviest},
            **({"probe_us": round(statistics.median(probes), 2)} if probes else {})}


def traces_since(directory: str | Path, since: float, pattern: str = "*.json*") -> list[Path]:
    """The trace files in ``directory`` modified at or after ``since`` (epoch seconds), oldest first: one per GPU
    where the engine runs on several."""
    found = [p for p in Path(directory).glob(pattern) if p.is_file() and p.stat().st_mtime >= since]
    return sorted(found, key=lambda p: p.stat().st_mtime)
