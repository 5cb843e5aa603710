"""Small-batch latency: split vs combine GPU time (kineto) for planner / combine settings (device experiment)."""
import dataclasses
import itertools

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from mla_backend import MLADecodeMetadata, SplitPlanner, mla_decode, planner
from mla_backend.kernels import configs, runtime


def run(b, s, h, sq, ps, min_blocks, combine_rows):
    planner.MIN_BLOCKS_PER_PART = min_blocks
    name = configs.DEFAULT_SM90_KERNEL
    configs.SM90_KERNELS[name] = dataclasses.replace(configs.SM90_KERNELS[name], combine_rows=combine_rows)
    pages = b * s // ps
    kv = torch.randn(pages, ps, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages, device="cuda").int().view(b, s // ps)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    q = torch.randn(b * sq, h, 576, dtype=torch.bfloat16, device="cuda")
    md = MLADecodeMetadata.from_block_table(table, lens, ps, q_len=sq)
    md.plan = SplitPlanner(b, h, sq, "cuda").plan(lens)
    out = torch.empty(b * sq, h, 512, dtype=torch.bfloat16, device="cuda")
    fn = lambda: mla_decode(q, kv, md, 0.07, out=out, check_indices=False)  # noqa: E731
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    t = do_bench(graph.replay, warmup=50, rep=200, return_mode="median") * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
    per = {}
    for e in prof.key_averages():
        if "mla_decode" in e.key:
            per[e.key.split("_kernel")[0][-7:]] = e.device_time_total / max(e.count, 1)
    print(f"b={b:3d} s={s:5d} h={h:3d} min_blocks={min_blocks} combine_rows={combine_rows}: graph {t:7.1f} us  "
          + "  ".join(f"{k} {v:6.1f}" for k, v in per.items()), flush=True)


for (b, s, h), mb, cr in itertools.product([(1, 4096, 16), (16, 4096, 16), (1, 32768, 128)], [1, 4], [8, 1]):
    run(b, s, h, 1, 64, mb, cr)
run(128, 16384, 16, 1, 64, 4, 1)
run(128, 16384, 128, 1, 64, 4, 1)
