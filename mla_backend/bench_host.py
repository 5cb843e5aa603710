"""Host time of one decode call: ``mla_decode``, ``MLADecodeLauncher`` and vLLM 0.26's FlashMLA and FA3 MLA calls.

``mla-backend bench --host [--calls 2000] [--evict-mb 8] [--impls mla_decode,launcher,flashmla,fa3] [--out-dir DIR]``

Shapes (b, s_k, h): (1, 4096, 16), (16, 4096, 128), (64, 4096, 128), (32, 8192, 32); bf16, page 64, q_len 1, fixed
lengths, the inputs and anchor calls of ``mla-backend bench`` (``bench.Case``, ``bench.make_runner``). ``mla_decode``
is called with ``out`` and ``check_indices=False``, the launcher with ``out`` (LSE not returned); both read a plan made
ahead, once, as an engine plans once per step for all its layers.

* host µs: ``perf_counter`` around each call, p50 and p99 over ``--calls`` calls. The GPU is kept ahead: each chunk
  of calls is issued behind a spin kernel longer than the chunk's host time, so no call waits on the GPU (a full
  launch queue would otherwise put the GPU time into the host time); ``spin_covered`` counts the chunks whose spin
  was still running when their last call returned.
* cold µs (``--evict-mb N``): the same, with an N-MB host buffer swept before each call (one byte written per
  64-byte line), so that the call finds its code's data and much of its code out of the CPU's caches. Inside an
  engine the model's own host code runs between two decode calls and leaves them so: a hot loop shows what the
  call costs with everything cached, the cold column what it costs where an engine calls it.
* eager µs: a loop of calls with one sync at its end, divided by the count (median of 5 loops): what a layer costs
  when nothing else hides the host or the GPU time, the larger of the two.
* per step, once for all layers: the split planner (``plan``) and vLLM's metadata build (``vllm_build``; without
  the plan, which the step's first attention call makes, inside the graph under full CUDA graphs), host µs.

Writes ``host.json`` and ``host.md`` to ``--out-dir``. Exit status 2 when nothing ran (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from . import bench
from .bench import SOFTMAX_SCALE, Case, Config, KVGroup, Skip, make_runner
from .cli import nothing_ran

SHAPES = ((1, 4096, 16), (16, 4096, 128), (64, 4096, 128), (32, 8192, 32))
IMPLS = ("mla_decode", "launcher", "flashmla", "fa3")
CHUNK = 100  # calls issued behind one spin: ~200-300 launches, far below the launch queue's depth


def spin_cycles_per_us(device) -> float:
    """The spin kernel's clock, measured (``torch.cuda._sleep`` counts SM cycles)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 20_000_000 / (start.elapsed_time(end) * 1e3)


class CacheSweep:
    """Writes one byte in every 64-byte line of an ``mb``-MB host buffer: the lines a call would find cached are
    evicted. A bytearray's slice assignment, one C loop, so the sweep warms no Python or torch code of its own."""

    def __init__(self, mb: int):
        self.buffer = bytearray(mb << 20)
        self.ones = b"\x01" * (len(self.buffer) // 64)

    def __call__(self) -> None:
        self.buffer[::64] = self.ones


def host_us(fn, calls: int, cycles_per_us: float, sweep=None) -> dict:
    """p50 / p99 host µs of ``fn`` over ``calls`` calls, each chunk issued behind a spin kernel; ``sweep`` (a
    :class:`CacheSweep`) runs before each call, outside its timing."""
    sweep = sweep or (lambda: None)
    probe = []
    for _ in range(20):
        sweep()
        t0 = time.perf_counter()
        fn()
        probe.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    per_call_us = max(statistics.median(probe) * 1e6, 20.0) + sweep_us(sweep)
    ts, covered, chunks = [], 0, 0
    for start in range(0, calls, CHUNK):
        n = min(CHUNK, calls - start)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4 * n * per_call_us * cycles_per_us) + 100_000)
        spun = torch.cuda.Event()
        spun.record()
        for _ in range(n):
            sweep()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        covered += not spun.query()
        chunks += 1
    torch.cuda.synchronize()
    ts.sort()
    us = [t * 1e6 for t in ts]
    return {"p50": statistics.median(us), "p99": us[min(len(us) - 1, int(0.99 * len(us)))], "mean": statistics.fmean(us),
            "calls": len(us), "spin_covered": f"{covered}/{chunks}"}


def sweep_us(sweep) -> float:
    """µs one sweep takes (the spin kernel must also cover the sweeps of its chunk)."""
    t0 = time.perf_counter()
    for _ in range(5):
        sweep()
    return (time.perf_counter() - t0) / 5 * 1e6


def eager_us(fn, n: int = 200, loops: int = 5) -> float:
    """GPU + host time per call: ``n`` calls, one sync at the end; median over ``loops``."""
    vals = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        vals.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(vals)


def step_runners(c: Case) -> dict:
    """Per-step host work: the planner alone, and vLLM's decode metadata build as the plugin makes it, without the
    plan (same block table)."""
    from .vllm_plugin.translate import DecodeMetadataBuilder

    cfg, kvg = c.cfg, c.kvg
    builder = DecodeMetadataBuilder(cfg.b, cfg.h, cfg.page, (cfg.s_q,), kvg.seqlens.device)
    qsl = torch.arange(cfg.b + 1, dtype=torch.int32) * cfg.s_q
    return {"plan": lambda: c.planner.plan(kvg.seqlens),
            "vllm_build": lambda: builder.build(kvg.block_table, kvg.seqlens, qsl, c.T, kvg.max_len, plan=False)}


def runners(c: Case, anchors: dict, impls) -> dict:
    from .launcher import MLADecodeLauncher

    out = {}
    for name in impls:
        try:
            if name == "mla_decode":
                out[name] = make_runner("ours", c, anchors, graphs=False)
            elif name == "launcher":
                cfg, dev = c.cfg, c.q.device
                launch = MLADecodeLauncher(dev, cfg.h, page_size=cfg.page, dtype=torch.bfloat16,
                                           softmax_scale=SOFTMAX_SCALE, q_lens=(cfg.s_q,))
                if launch.variant(cfg.s_q).is_reference:
                    raise Skip(f"no kernel: {launch.variant(cfg.s_q).reason}")
                o = torch.empty(c.T, cfg.h, bench.LATENT, dtype=torch.bfloat16, device=dev)
                out[name] = lambda launch=launch, o=o: launch(c.q_nope, c.q_pe, c.kvg.kv, c.md, o)
            else:
                out[name] = make_runner(name, c, anchors, graphs=False)
        except Skip as e:
            out[name] = str(e)
    return out


def run(args) -> list[dict]:
    device = torch.device(args.device)
    impls = [n for n in args.impls.split(",") if n]
    cfgs = [Config(b, s, h, 1, False) for b, s, h in SHAPES]
    bench.precompile(cfgs, ["ours"], device)
    anchors = bench.load_anchors({"flashmla", "fa3"} & set(impls))
    for name, mod in anchors.items():
        if isinstance(mod, str):
            print(f"skip {name}: {mod}")
    cycles = spin_cycles_per_us(device)
    sweep = CacheSweep(args.evict_mb) if args.evict_mb else None
    results = []
    for cfg in cfgs:
        torch.cuda.empty_cache()
        c = Case(cfg, KVGroup(cfg, args.seed, device, fp8=False), args.seed, device)
        rec = {"label": f"b={cfg.b} s_k={cfg.s_k} h={cfg.h}", "b": cfg.b, "s_k": cfg.s_k, "h": cfg.h, "impls": {},
               "step": {}}
        calls = runners(c, anchors, impls)
        for name, fn in calls.items():
            if isinstance(fn, str):
                rec["impls"][name] = {"skip": fn}
                continue
            try:
                for _ in range(20):  # compile / load, fill the anchors' lazily made metadata
                    fn()
                torch.cuda.synchronize()
                rec["impls"][name] = {**host_us(fn, args.calls, cycles), "eager_us": eager_us(fn)}
                if sweep:
                    rec["impls"][name]["cold"] = host_us(fn, args.calls, cycles, sweep)
            except Exception as e:  # noqa: BLE001 - keep timing the others
                rec["impls"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"WARNING: {name} failed on {rec['label']}: {rec['impls'][name]['error']}")
        if callable(calls.get("mla_decode")) and callable(calls.get("launcher")):
            rec["launcher_equals_mla_decode"] = bool(torch.equal(calls["mla_decode"](), calls["launcher"]()))
        for name, fn in step_runners(c).items():
            fn()
            rec["step"][name] = host_us(fn, min(args.calls, 1000), cycles)["p50"]
            if sweep:
                rec["step"][name + "_cold"] = host_us(fn, min(args.calls, 1000), cycles, sweep)["p50"]
        cells = "  ".join(f"{n} {v['p50']:.1f}/{v['eager_us']:.1f}" for n, v in rec["impls"].items() if "p50" in v)
        same = rec.get("launcher_equals_mla_decode")
        print(f"{rec['label']}: {cells or 'nothing ran'}  (host p50 / eager us; plan {rec['step']['plan']:.1f}, "
              f"vllm build {rec['step']['vllm_build']:.1f}" + ("" if same is None else f"; launcher output == "
                                                                 f"mla_decode's: {same}") + ")", flush=True)
        results.append(rec)
        del c, calls
    return results


def table(results: list[dict], impls, cold: bool = False) -> list[str]:
    """Markdown rows: per impl host p50 / p99 (and cold p50 / p99 with ``--evict-mb``) and eager µs; per step the
    planner and vLLM's build (hot, or hot / cold)."""
    per_impl = ("host p50 / p99 µs", "cold p50 / p99 µs", "eager µs") if cold else ("host p50 / p99 µs", "eager µs")
    step = " / cold" if cold else ""
    head = "| shape | " + " | ".join(f"{n} {what}" for n in impls for what in per_impl) + \
        f" | plan µs{step} | vLLM build µs{step} |"
    lines = [head, "|---" * (len(per_impl) * len(impls) + 3) + "|"]
    pair = lambda v: f"{v['p50']:.1f} / {v['p99']:.1f}"  # noqa: E731
    for r in results:
        cells = []
        for n in impls:
            v = r["impls"].get(n, {})
            if "p50" not in v:
                cells += ["–"] * len(per_impl)
                continue
            cells += [pair(v)] + ([pair(v["cold"])] if cold else []) + [f"{v['eager_us']:.1f}"]
        steps = [" / ".join(f"{r['step'][k]:.1f}" for k in (name, name + "_cold") if k in r["step"])
                 for name in ("plan", "vllm_build")]
        lines.append(f"| {r['label']} | " + " | ".join(cells + steps) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mla-backend bench --host", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="timed calls per implementation and shape (>= 2000 for "
                                                            "a p99)")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="also time each call after sweeping this many MB of host memory (a cold call, as inside an "
                        "engine); 0: hot only")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--out-dir", default="mla_bench_results", help="host.json and host.md go here; '' = none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if bad := [n for n in args.impls.split(",") if n and n not in IMPLS]:
        p.error(f"unknown impl(s) {bad}; choose from {','.join(IMPLS)}")
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_sleep"):
        return nothing_ran("bench --host", f"no CUDA GPU visible to torch {torch.__version__}; nothing to time.")
    env = bench.environment(["--host", *(sys.argv[1:] if argv is None else argv)])
    print(f"{env.get('gpu')}: torch {env['torch']}, vllm {env['vllm']}, tilelang {env['tilelang']}; host timing of "
          f"{args.impls}, {args.calls} calls each")
    results = run(args)
    # tvm-ffi converts torch tensors through torch's C DLPack exchange API where torch has it (natively, or from
    # torch-c-dlpack-ext / its JIT build); otherwise through Python DLPack calls, several µs per tensor argument
    env["tvm_ffi_torch_c_exchange"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    env["tvm_ffi"] = getattr(sys.modules.get("tvm_ffi"), "__version__", None)
    print(f"tvm-ffi {env['tvm_ffi']}: torch tensors converted through the C exchange API: "
          f"{env['tvm_ffi_torch_c_exchange']}")
    impls = [n for n in IMPLS if n in args.impls.split(",")]
    lines = table(results, impls, cold=bool(args.evict_mb))
    print("\n".join(lines))
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "host.json"), "w") as f:
            json.dump({"env": env, "calls": args.calls, "chunk": CHUNK, "results": results}, f, indent=1)
        with open(os.path.join(args.out_dir, "host.md"), "w") as f:
            f.write(f"### Host time per decode call on {env.get('gpu')} ({env['date'][:10]})\n\n"
                    f"torch {env['torch']}, vLLM {env['vllm']}, tilelang {env['tilelang']}, commit {env.get('git')}. "
                    f"Command: `{env['command']}`. bf16, page 64, q_len 1; host: perf_counter around each call "
                    f"with the GPU kept ahead ({args.calls} calls)"
                    + (f"; cold: the same after sweeping {args.evict_mb} MB of host memory before each call"
                       if args.evict_mb else "") + "; eager: calls in a loop, one sync, per call.\n\n"
                    + "\n".join(lines) + "\n")
        print(f"wrote {args.out_dir}/host.json, {args.out_dir}/host.md")
    if not any("p50" in v for r in results for v in r["impls"].values()):
        return nothing_ran("bench --host", "no implementation was timed (see the skips and errors above).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
