"""Quick timing of our kernel alone (the full side-by-side benchmark is mla_backend/bench.py).

``--smoke``: two small ragged cases (bf16 and e4m3 caches) against the fp32 reference (exits 1 on a mismatch).
``--fp8``: h=16 cases with a bf16 and an e4m3 cache (k_scale 0.5) in the same run.
``--fp16``: fp16 q / output (and bf16 -> fp16 cache) instead of bf16.
``--cases 0,2``: only these entries of the case list (indices).
``--shapes 1,4096,16,1,64;128,16384,128,1,64,fp8``: these (b, s, h, s_q, page[, fp8][, ragged]) problems instead
(ragged: the bench's lengths ~N(s, s/2)).
``--kineto``: also the split and combine kernels' own GPU time (profiler, graph replays).
``--precompile N``: only compile the Hopper kernel variants of the selected problems into TileLang's disk cache,
N at a time (no GPU needed), for a later timing run to load.
``--ncu``: one eager call per case and variant, no timing (for a profiler).
``--plan``: the split planner's GPU time per step, the one-launch kernel against the torch ops."""
import sys

import torch

from mla_backend import MLADecodeMetadata, SplitPlanner, mla_decode
from mla_backend.bench import bytes_moved, flops

CASES = [(128, 16384, 16, 1, 64), (128, 16384, 128, 1, 64), (128, 16384, 128, 2, 64), (1, 4096, 16, 1, 64),
         (16, 4096, 16, 1, 64), (128, 16384, 16, 1, 1), (128, 16384, 16, 1, 16), (64, 8192, 16, 1, 64),
         (128, 16384, 16, 2, 64), (64, 8192, 64, 1, 64)]
FP8_CASES = [(128, 16384, 16, 1, 64), (128, 16384, 16, 1, 16), (128, 16384, 16, 1, 1), (64, 8192, 16, 1, 64),
             (1, 4096, 16, 1, 64), (128, 16384, 16, 2, 64)]


def smoke(kernel: str) -> int:
    """Two small ragged cases (page 64, h=16, bf16 and e4m3 caches) against the fp32 reference: sanitize_case's."""
    from sanitize_case import SHORT, run_case

    errs = [run_case(64, 16, 1, fp8, SHORT) for fp8 in (False, True)]
    print(f"smoke {kernel}: rel err bf16 {errs[0]:.2e}, e4m3 {errs[1]:.2e}")
    return 0 if errs[0] < 1e-2 and errs[1] < 2e-2 else 1


def plan_times() -> int:
    """The planner's GPU time per step (the bench's timing: L2 flushed, median) and its host time."""
    from mla_backend.bench import Timer

    timer = Timer("cuda")
    for heads, q_len in ((16, 1), (128, 1), (128, 2)):
        for batch in (1, 64, 256):
            lens = torch.randint(1, 32768, (batch,), dtype=torch.int32, device="cuda")
            planner = SplitPlanner(256, heads, q_len, "cuda")
            plan = lambda: planner.plan(lens)  # noqa: E731
            plan()
            host = timer.host_us(plan)
            print(f"plan h={heads:3d} s_q={q_len} b={batch:3d}: {timer(plan, 30, host)['us']:6.1f} us "
                  f"(host {host:5.1f})", flush=True)
    return 0


def q_dtype() -> torch.dtype:
    return torch.float16 if "--fp16" in sys.argv else torch.bfloat16


def decode_problem(b: int, s: int, h: int, sq: int, ps: int, fp8: bool = False, ragged: bool = False,
                   seq: bool = False, fp8_compute: bool = False, long_len: int = 0):
    """A bf16 problem (fixed lengths, or the bench's ragged ones; ``long_len``: the last request that long) with
    pages in random order (``seq``: in order, a diagnostic of page locality), planned: the eager call
    (``fp8_compute``: mla_decode's, for an e4m3 cache), its metadata (``md.plan`` holds the workspaces) and (bytes,
    flops) for the rates."""
    from mla_backend.bench import Config, seq_lens

    len_list = seq_lens(Config(b, s, h, sq, ragged, ps, long_len=long_len))
    width = -(-max(len_list) // ps)  # pages per row of the block table
    dtype = q_dtype()
    kv = torch.randn(b * width, ps, 576, dtype=dtype, device="cuda")
    if fp8:
        kv = (kv * 2).to(torch.float8_e4m3fn)
    table = (torch.arange if seq else torch.randperm)(b * width, device="cuda").int().view(b, width)
    lens = torch.tensor(len_list, dtype=torch.int32, device="cuda")
    q = torch.randn(b * sq, h, 576, dtype=dtype, device="cuda")
    md = MLADecodeMetadata.from_block_table(table, lens, ps, q_len=sq)
    md.plan = SplitPlanner(b, h, sq, "cuda").plan(lens)
    out = torch.empty(b * sq, h, 512, dtype=dtype, device="cuda")
    eager = lambda: mla_decode(q, kv, md, 0.07, out=out, check_indices=False,  # noqa: E731
                               k_scale=0.5 if fp8 else None, fp8_compute=fp8_compute)
    sum_len = sum(len_list)
    return eager, md, (bytes_moved(sum_len, b, sq, h, kv.element_size()), flops(sum_len, sq, h))


SHAPE_FLAGS = ("fp8", "ragged", "seq")
LONG = "long="  # "long=N": the last request N tokens long (``bench --grid mixed``'s batch)


def parse_shapes(text: str) -> list:
    """"b,s,h,s_q,page[,fp8][,ragged][,seq][,long=N];..." -> [((b, s, h, s_q, page), {"fp8": .., "ragged": ..,
    "seq": .., "long_len": N or 0})]: a trailing "fp8" times an e4m3 cache, "ragged" the bench's ragged lengths,
    "seq" pages in order, "long=N" the last request N tokens long."""
    shapes = []
    for x in (y.split(",") for y in text.split(";")):
        flags = [f for f in x[5:] if not f.startswith(LONG)]
        if not set(flags) <= set(SHAPE_FLAGS):
            raise SystemExit(f"--shapes: unknown flag(s) {flags} ({', '.join(SHAPE_FLAGS)}, {LONG}N)")
        long_len = max([int(f[len(LONG):]) for f in x[5:] if f.startswith(LONG)], default=0)
        shapes.append((tuple(int(v) for v in x[:5]), {**{f: f in flags for f in SHAPE_FLAGS}, "long_len": long_len}))
    return shapes


def shape_flags(opts: dict) -> str:
    """parse_shapes' flags that are set, as printed after a shape: " fp8 ragged seq long=N"."""
    return "".join(f" {flag}" for flag in SHAPE_FLAGS if opts.get(flag)) + (
        f" {LONG}{opts['long_len']}" if opts.get("long_len") else "")


def decode_step(b: int, s: int, h: int, sq: int, ps: int, fp8: bool = False, ragged: bool = False,
                seq: bool = False, long_len: int = 0):
    """decode_problem's call, run once and captured: the CUDA graph's replay (as engines run decode), the eager
    call, and (bytes, flops) for the rates."""
    eager, _, rates = decode_problem(b, s, h, sq, ps, fp8, ragged, seq, long_len=long_len)
    eager()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    return graph.replay, eager, rates


def kernel_times(replay) -> str:
    """Mean GPU time of the split and combine kernels over 20 graph replays (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    per = {e.key: e.device_time_total / max(e.count, 1) for e in prof.key_averages() if "mla_decode" in e.key}
    return "".join(f" | {'combine' if 'combine' in k else 'split'} {v:7.1f} us" for k, v in sorted(per.items()))


def main() -> int:
    from mla_backend.kernels.configs import config_for

    kernel = config_for("sm90").kernel
    if "--smoke" in sys.argv:
        return smoke(kernel)
    if "--plan" in sys.argv:
        return plan_times()
    fp8_mode = "--fp8" in sys.argv
    cases = FP8_CASES if fp8_mode else CASES
    if "--cases" in sys.argv:
        cases = [cases[int(i)] for i in sys.argv[sys.argv.index("--cases") + 1].split(",")]
    runs = [(c, {"fp8": fp8, "ragged": False}) for c in cases for fp8 in ((False, True) if fp8_mode else (False,))]
    if "--shapes" in sys.argv:
        runs = parse_shapes(sys.argv[sys.argv.index("--shapes") + 1])
    from triton.testing import do_bench  # here: the shape parser above is imported on machines without triton
    if "--precompile" in sys.argv:
        from mla_backend import warmup

        dtype, workers = q_dtype(), int(sys.argv[sys.argv.index("--precompile") + 1])
        shapes = [(h, sq, ps, dtype, torch.float8_e4m3fn if o["fp8"] else dtype) for (_, _, h, sq, ps), o in runs]
        ready = warmup("cuda", shapes=shapes, workers=workers)
        print(f"precompiled {len(ready.variants)} variant(s) in {ready.seconds:.1f} s")
        return 0
    for (b, s, h, sq, ps), opts in runs:
        fp8 = opts["fp8"]
        replay, eager, (nbytes, flop) = decode_step(b, s, h, sq, ps, **opts)
        if "--ncu" in sys.argv:
            continue
        t_eager = do_bench(eager, warmup=50, rep=300, return_mode="median") * 1e-3  # s
        t = do_bench(replay, warmup=50, rep=300, return_mode="median") * 1e-3
        print(f"{kernel}{'-fp16' if '--fp16' in sys.argv else ''}{'-fp8' if fp8 else ''}{shape_flags({**opts, 'fp8': False})} b={b:4d} s={s:6d} h={h:3d} s_q={sq} page={ps:3d}: graph "
              f"{t*1e6:8.1f} us {nbytes/t/1e9:7.0f} GB/s {flop/t/1e12:6.1f} TF | eager {t_eager*1e6:8.1f} us"
              + (kernel_times(replay) if "--kineto" in sys.argv else ""), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
