"""Quick timing of our kernel alone (the full side-by-side benchmark is mla_backend/bench.py)."""
import sys
import torch
from mla_backend import MLADecodeMetadata, SplitPlanner, mla_decode
from triton.testing import do_bench

cases = [(128, 16384, 16, 1, 64), (128, 16384, 128, 1, 64), (128, 16384, 128, 2, 64), (1, 4096, 16, 1, 64),
         (128, 16384, 16, 1, 1), (128, 16384, 16, 1, 16), (64, 8192, 16, 1, 64)]
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
for b, s, h, sq, ps in cases:
    pages = b * s // ps
    kv = torch.randn(pages, ps, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(pages, device="cuda").int().view(b, s // ps)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    q = torch.randn(b * sq, h, 576, dtype=torch.bfloat16, device="cuda")
    md = MLADecodeMetadata.from_block_table(table, lens, ps, q_len=sq)
    md.plan = SplitPlanner(b, h, sq, "cuda").plan(lens)
    out = torch.empty(b * sq, h, 512, dtype=torch.bfloat16, device="cuda")
    fn = lambda: mla_decode(q, kv, md, 0.07, out=out, check_indices=False)
    fn()
    t = do_bench(fn, warmup=50, rep=300, return_mode="median", grad_to_none=None) * 1e-3  # s
    nbytes = (b * s * 576 + b * sq * h * 1088) * 2
    flops = 2 * sq * b * s * h * 1088
    print(f"b={b:4d} s={s:6d} h={h:3d} s_q={sq} page={ps:3d}: {t*1e6:8.1f} us {nbytes/t/1e9:7.0f} GB/s {flops/t/1e12:6.1f} TF", flush=True)
    del kv, table
