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
from collections import defaultdict
from pathlib import Path

from ..host_trace import call_percentiles

# First match wins: the KV-cache write before attention, since its kernel names mention MLA too.
CATEGORY_PATTERNS = (
    ("kv_cache_write", re.compile(r"concat_and_cache|reshape_and_cache|set_mla_kv|set_kv_buffer|store_kv", re.I)),
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
    and, given the number of profiled ``steps``, attention and total microseconds per step."""
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
        result.update(steps=steps, attention_us_per_step=round(attention / steps, 1),
                      kernel_us_per_step=round(total / steps, 1))
    return result


# Host ranges: the plugins' own (mla_backend.host_trace: metadata build per step, decode call per layer), the
# engines' attention op, which every backend's layer calls from Python outside FULL CUDA graphs (vLLM's piecewise
# steps), and HOST_PROBE_OP. torch.profiler writes record_function ranges as user_annotation, torch ops as cpu_op.
#: A torch op that the engine's own step code calls alike whatever the backend: its time per call tells how fast this
#: engine process's host ran (engines of one backend have differed 1.8x in it, from where their processes ran), to
#: read a host-bound step's TPOT against.
HOST_PROBE_OP = "aten::slice"
HOST_RANGE_PATTERN = re.compile(r"^mla_backend\.|unified_(mla_)?attention|^" + re.escape(HOST_PROBE_OP) + "$", re.I)
HOST_CATEGORIES = ("user_annotation", "cpu_op")


def host_ranges(events: list[dict]) -> dict:
    """Host time of each named range matching :data:`HOST_RANGE_PATTERN`: calls and p50 / p99 / max microseconds."""
    durations: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and e.get("ph", "X") == "X" and HOST_RANGE_PATTERN.search(e.get("name", "")):
            durations[e["name"]].append(float(e.get("dur", 0.0)))
    return {name: call_percentiles(values) for name, values in sorted(durations.items())}


def newest_trace(directory: str | Path, since: float, pattern: str = "*.json*") -> Path | None:
    """The most recently written trace file in ``directory`` modified at or after ``since`` (epoch seconds)."""
    candidates = [p for p in Path(directory).glob(pattern) if p.is_file() and p.stat().st_mtime >= since]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
