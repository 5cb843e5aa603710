"""Per-block timeline of one program of the ws split kernel (GPU): every role's clock at each step of blocks 0..63.

    python scripts/trace_blocks.py [--part P] [--shapes "128,16384,128,2,64;65,1024,128,1,64,ragged,long=16384"]
                                   [--fp8c] [--raw FILE]

A shape is quick_time's: b,s_k,h,s_q,page, then optionally ``ragged`` (the bench's ragged lengths), ``seq`` and
``long=N`` (the last request N tokens long: ``bench --grid mixed``'s batch); the cache's dtype is ``--fp8c``'s.
Builds the Hopper kernel with ``KernelConfig.trace_part = P`` (clock64 per step into the plan's unused last partial
slot), runs a few eager decodes of each shape and reports, over the steady blocks (4..59; in a program of fewer than
61 blocks, all but its first and last) of the last launch, the median cycles of:
  WG0: k wait (an fp8 cache's whole block; a 16-bit cache waits per tile inside S, so there it is the stamps' own
       cost), S, the p_free wait and softmax (mask, max, exp2, P to registers, alpha), nothing (two stamps back to
       back: their cost), P store and the P V issue + p_ready, the row sums, P V wait, and the block period;
  WG1: k wait, p_ready wait, P V (rescale, GEMM, wait);
  producer: page ids, k_free wait (buffer reuse), copy issue;
and each role's clock rate over the whole program (clock64 against %globaltimer); a program of fewer than 61 blocks
(short requests) also gets each block's WG0 period and k wait, where a request segment's start shows as a long one,
and with ``--fp8c`` each request segment's start and end: WG0's wait for Q8 and its epilogue before it, the
producer's wait for q_free and its quantisation of Q, WG1's wait for WG0's l and its epilogue.
``--fp8c``: the fp8-compute kernel on an e4m3 cache (FP8C_STEPS: its P V is one step, issue and wait, and its
producer only issues the next block's copy and waits for its own). A traced decode's outputs are not checked (the
trace shares nothing with them, but this is a profiling run)."""
import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = {0: ("k wait", "S", "p_free wait + softmax", "stamps", "P store + PV issue", "row sums", "PV wait"),
         1: ("k wait", "p_ready wait", "PV"),
         2: ("pages", "k_free wait", "issue")}
FP8C_STEPS = {0: ("k wait", "S", "softmax", "p_free wait", "P8 store", "PV"),
              1: ("p_ready wait", "k wait", "PV"),
              2: ("next copy", "own copy wait")}
ROLES = {0: "WG0", 1: "WG1", 2: "producer"}


def summarise(words: list, shape: str, call_us: float, steps: dict = STEPS) -> str:
    """``words``: the traced program's int64 record (kernels/sm90/protocol.py's TRACE_PRELUDE layout)."""
    from mla_backend.kernels.sm90.protocol import TRACE_BLOCKS, TRACE_HEAD, TRACE_ROLES, TRACE_STEPS

    clock = {(r, g): words[(r * TRACE_BLOCKS + g) * TRACE_STEPS:(r * TRACE_BLOCKS + g + 1) * TRACE_STEPS]
             for r in range(TRACE_ROLES) for g in range(TRACE_BLOCKS)}
    out = [f"shape b,s,h,s_q,page = {shape}: decode call {call_us:.1f} us (eager, traced kernel); "
           "median cycles over blocks 4..59"]
    for role in range(3):
        c0, ns0, c1, ns1 = words[TRACE_HEAD + role * 4:TRACE_HEAD + role * 4 + 4]
        if ns1 > ns0:
            out.append(f"  {ROLES[role]}: {c1 - c0} cycles in {(ns1 - ns0) / 1e3:.1f} us "
                       f"({(c1 - c0) / (ns1 - ns0):.3f} GHz)")
    blocks = next((g for g in range(TRACE_BLOCKS) if not clock[0, g][0]), TRACE_BLOCKS)  # WG0 stamps each start
    steady = range(4, 60) if blocks > 60 else range(1, blocks - 2)
    out[0] += f" ({blocks} blocks traced)" if blocks <= 60 else ""
    for role, names in steps.items():
        if not steady or not all(clock[role, g][len(names)] for g in range(steady.start, steady.stop + 1)):
            out.append(f"  {ROLES[role]}: no trace (fewer than 4 blocks, or not this kernel's path)")
            continue
        cols = [f"{name} {statistics.median(clock[role, g][k + 1] - clock[role, g][k] for g in steady):.0f}"
                for k, name in enumerate(names)]
        last = len(names)
        cols.append(f"to next {statistics.median(clock[role, g + 1][0] - clock[role, g][last] for g in steady):.0f}")
        cols.append(f"period {statistics.median(clock[role, g + 1][0] - clock[role, g][0] for g in steady):.0f}")
        out.append(f"  {ROLES[role]:8s} " + ", ".join(cols))
    if not steady:
        return "\n".join(out)
    g0 = min(20, steady.stop - 1)
    t0 = clock[0, g0][0]  # two blocks' steps on one clock, from WG0's start of block g0
    for g in (g0, g0 + 1):
        for role, names in steps.items():
            out.append(f"  g={g} {ROLES[role]:8s} " + " ".join(f"{v - t0:6d}" for v in clock[role, g][:len(names) + 1]))
    if blocks <= 60:
        out.append("  WG0 per block (period / k wait): " + ", ".join(
            f"{g}: {clock[0, g + 1][0] - clock[0, g][0]}/{clock[0, g][1] - clock[0, g][0]}" for g in range(blocks - 1)))
    if steps is FP8C_STEPS:
        out += segment_lines(clock, blocks)
    return "\n".join(out)


def segment_lines(clock: dict, blocks: int) -> list[str]:
    """The fp8-compute kernel's request segments (protocol.SEG_TRACE_STEP's stamps on each segment's first block):
    what a segment's start and end cost each role, in cycles."""
    from mla_backend.kernels.sm90.protocol import SEG_TRACE_STEP as SEG

    starts = [g for g in range(blocks) if clock[0, g][SEG]]
    pv_end = {role: len(FP8C_STEPS[role]) for role in (0, 1)}  # each consumer's stamp after its P V
    out = [f"  segments: {len(starts)} (first blocks {starts})"]
    for i, g0 in enumerate(starts):
        last = (starts[i + 1] if i + 1 < len(starts) else blocks) - 1
        wg0 = clock[0, g0]
        parts = [f"  segment g={g0}..{last}: WG0 waits for Q8 {wg0[0] - wg0[SEG]}"]
        if g0:
            parts.append(f"after its previous epilogue of {wg0[SEG] - clock[0, g0 - 1][pv_end[0]]}")
        producer = clock[2, g0]
        if producer[SEG]:
            parts.append(f"producer: q_free wait {producer[SEG - 1] - producer[SEG - 2]}, Q8 quantised in "
                         f"{producer[SEG] - producer[SEG - 1]} (ready {wg0[0] - producer[SEG]} before WG0's S)")
        wg1 = clock[1, g0]
        if wg1[SEG] and clock[1, last][pv_end[1]]:
            epilogue = f" {clock[1, last + 1][0] - wg1[SEG]}" if last + 1 < blocks and clock[1, last + 1][0] else ""
            parts.append(f"WG1: waits {wg1[SEG] - clock[1, last][pv_end[1]]} for WG0's l, then its epilogue{epilogue}")
        out.append("; ".join(parts))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", type=int, default=5)
    p.add_argument("--shapes", default="128,16384,128,2,64;128,16384,128,1,64", help="b,s,h,s_q,page;...")
    p.add_argument("--raw", help="append each shape's int64 record here")
    p.add_argument("--fp8c", action="store_true", help="the fp8-compute kernel, on an e4m3 cache")
    args = p.parse_args()
    from mla_backend.kernels import configs
    from mla_backend.kernels.sm90.protocol import TRACE_WORDS
    from quick_time import decode_problem, parse_shapes

    # the traced kernel (configs.config_for reads these at each build)
    configs.CONFIGS["sm90"] = dataclasses.replace(configs.SM90, trace_part=args.part)
    configs.SM90_FP8_COMPUTE = dataclasses.replace(configs.SM90_FP8_COMPUTE, trace_part=args.part)
    for shape, (dims, opts) in zip(args.shapes.split(";"), parse_shapes(args.shapes)):
        if opts.pop("fp8"):
            raise SystemExit(f"--shapes: {shape!r}: the cache is e4m3 with --fp8c, 16-bit without")
        eager, md, _ = decode_problem(*dims, fp8=args.fp8c, fp8_compute=args.fp8c, **opts)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(4):  # the first compiles; the last launch's record is read
            md.plan.out_partial[-1].zero_()
            start.record()
            eager()
            end.record()
        torch.cuda.synchronize()
        words = md.plan.out_partial[-1].flatten().view(torch.int64)[:TRACE_WORDS].tolist()
        if args.raw:
            with open(args.raw, "a") as raw:
                raw.write(f"{shape} " + " ".join(map(str, words)) + "\n")
        print(summarise(words, shape, start.elapsed_time(end) * 1e3, FP8C_STEPS if args.fp8c else STEPS), flush=True)
        del eager, md
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
