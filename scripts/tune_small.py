"""Small-batch latency: split vs combine GPU time (kineto) per planner setting (device experiment)."""
import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from mla_backend import planner
from quick_time import decode_step  # scripts/ is on sys.path when this runs as a script


def run(b, s, h, sq, ps, min_blocks):
    planner.min_blocks_per_part = lambda rows: min_blocks
    replay, _, _ = decode_step(b, s, h, sq, ps)
    t = do_bench(replay, warmup=50, rep=200, return_mode="median") * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if "mla_decode" in e.key:
            per[e.key.split("_kernel")[0][-7:]] = e.device_time_total / max(e.count, 1)
    print(f"b={b:3d} s={s:5d} h={h:3d} min_blocks={min_blocks}: graph {t:7.1f} us  "
          + "  ".join(f"{k} {v:6.1f}" for k, v in per.items()), flush=True)


for b, s, h in [(1, 4096, 16), (1, 32768, 128), (4, 2048, 16), (16, 4096, 16)]:
    for mb in (1, 2, 4):
        run(b, s, h, 1, 64, mb)
run(128, 16384, 16, 1, 64, 1)
run(128, 16384, 128, 1, 64, 1)
