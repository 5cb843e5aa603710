"""GPU machine: where the host time of one eager ``mla_decode`` call goes (the bench's ``host_us``).

Times each stage of the op's host path over many calls (perf_counter, no sync inside the window; at these sizes the
GPU finishes each call long before the host has issued the next, so no launch waits for it), then a cProfile of the
whole call.
    PYTHONPATH=$PWD:scripts python3 scripts/host_profile.py [b s h s_q page]
"""
import cProfile
import pstats
import statistics
import sys
import time

import torch

import mla_backend.op as op
from mla_backend.dispatch import select_impl
from mla_backend.kernels.configs import config_for
from mla_backend.kernels.runtime import get_kernels, pick_combine
from mla_backend.validation import check_inputs, check_scales, normalize_kv_cache, split_query
from quick_time import decode_problem


def stage_times(fn, n=2000):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def main():
    b, s, h, sq, ps = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else (1, 4096, 16, 1, 64)))
    eager, md, _ = decode_problem(b, s, h, sq, ps)
    eager()
    torch.cuda.synchronize()
    qt = torch.randn(b * sq, h, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(64, ps, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(b * sq, h, 512, dtype=torch.bfloat16, device="cuda")
    rows = {
        "whole call (mla_decode, check_indices=False)": lambda: eager(),
        "split_query + normalize_kv_cache": lambda: (split_query(qt), normalize_kv_cache(kv)),
        "check_inputs(check_indices=False)": lambda: check_inputs(*split_query(qt), kv, md, out, False),
        "check_scales": lambda: check_scales(0.07, None),
        "capturing()": lambda: op._capturing(qt.device),
        "select_impl": lambda: select_impl(qt.device, qt.dtype, kv.dtype, h, sq, ps, "auto"),
        "config_for": lambda: config_for("sm90"),
        "get_kernels": lambda: get_kernels(h, sq, ps, torch.bfloat16, torch.bfloat16, "sm90"),
        "pick_combine": lambda: pick_combine(get_kernels(h, sq, ps, torch.bfloat16, torch.bfloat16, "sm90"), b,
                                             h * sq, md.plan.num_parts),
        "torch.empty lse": lambda: torch.empty(b * sq, h, dtype=torch.float32, device="cuda"),
    }
    for name, fn in rows.items():
        print(f"{stage_times(fn):8.2f} us  {name}", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        eager()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
