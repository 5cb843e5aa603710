"""GPU machine: where a small decode's time goes, kernel by kernel, under the bench's timing (256 MB L2 flush and a
spin before every run). For each problem, eager and as a CUDA-graph replay: the median over runs of each kernel's
start (from the end of the spin, so it includes the launch latency) and duration, from the profiler's timeline.
    PYTHONPATH=$PWD:scripts python3 scripts/timeline.py "1,4096,16,1,64;1,64,16,1,64" [--min-blocks 1,2,4]
``--min-blocks``: also plan with at least this many KV blocks per part (planner.MIN_BLOCKS_PER_PART; <= 32 rows).
"""
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_backend.planner as planner
from mla_backend.bench import Timer
from quick_time import decode_step, parse_shapes


def timeline(fn, runs: int = 30) -> str:
    timer = Timer("cuda")
    spin = 200_000  # cycles (~100 us): the call is enqueued before the spin ends
    for _ in range(3):
        timer._run(fn, 1, spin)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timer._run(fn, runs, spin)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "Memcpy" not in e.name and "Memset" not in e.name),
                     key=lambda e: e.time_range.start)
    # per run: the flush's fill (~100 us), the spin, then the call's kernels
    per_name: dict[str, list[tuple[float, float]]] = {}
    ends, spin_end = [], None
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        if "sleep" in e.name or "spin" in e.name:
            spin_end = e.time_range.end
            ends.append([spin_end, spin_end])
        elif spin_end is not None and dur < 50:
            key = "combine" if "combine" in e.name else "split" if "mla_decode" in e.name else "kernel"
            per_name.setdefault(key, []).append((e.time_range.start - spin_end, dur))
            ends[-1][1] = e.time_range.end
    total = statistics.median(b - a for a, b in ends)
    cells = [f"{k} start {statistics.median(s for s, _ in v):5.1f} dur {statistics.median(d for _, d in v):5.1f}"
             for k, v in sorted(per_name.items(), key=lambda kv: kv[0] != "split")]
    return f"spin end -> last end {total:5.1f} us | " + " | ".join(cells)


def main() -> int:
    shapes = parse_shapes(sys.argv[1])
    mins = [int(x) for x in sys.argv[sys.argv.index("--min-blocks") + 1].split(",")] if "--min-blocks" in sys.argv \
        else [planner.MIN_BLOCKS_PER_PART]
    x = torch.ones(1024, device="cuda")
    print(f"one tiny torch kernel: {timeline(lambda: x.mul_(1.0))}", flush=True)
    for (b, s, h, sq, ps), opts in shapes:
        for m in mins:
            planner.MIN_BLOCKS_PER_PART = m
            replay, eager, _ = decode_step(b, s, h, sq, ps, **opts)
            tag = f"b={b} s={s} h={h} s_q={sq} page={ps} min_blocks={m}"
            print(f"{tag} graph: {timeline(replay)}", flush=True)
            print(f"{tag} eager: {timeline(eager)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
