"""``mla-backend serve-bench --workloads hostile``: a served engine under a hostile load loses nothing.

    mla-backend serve-bench --engine vllm|sglang --workloads hostile [--duration S] [--budget S] [--mtp on|off]
        [--backends OURS,REFERENCE[,BASELINE]] [--max-context 8192] [--kv-tokens N] [--seed 0] [--out-dir DIR]

Three engine processes, one after the other (hostile_vllm.py / hostile_sglang.py):

1. **load**: the first backend (ours by default) serves the hostile load of hostile_load.py for ``--duration``
   seconds or what ``--budget`` leaves (prefix caching, chunked prefill, a KV pool small enough to force preemption,
   aborts mid-decode, lengths 1 .. max context, changing concurrency, MTP), recording every request's outcome, tokens
   and logprobs and the engine's own counters;
2. **baseline load**: the third backend (a built-in) serves the same load for as long as ours sent, the same way;
3. **forced**: the second backend (the reference, a built-in, eager) re-runs the survivors of both loads, prompt +
   output as a prompt, and records its argmax at each output position (teacher forcing). Ours must agree with it as
   often as the baseline does: both were served the same way, so what they share (CUDA graphs, compiled fusions,
   MTP, near ties of random weights) cancels and what is left is the attention backend.

The report (hostile_report.py) counts requests sent / completed / aborted / failed / unfinished, preemptions, the
engine's error counters, non-finite logprobs and the agreement fractions, and writes hostile.json and hostile.md.
Exit status: 0 when every check passed, 1 when one failed, 2 when nothing ran (no GPU, engine missing).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

from . import hostile_report
from .hostile_load import (FORCED, LOAD, HostileLoad, HostileSpec, check_load, concurrency_schedule,
                           forced_selection, load_to_dict, plan_request, shared_prefixes)
from . import sglang_runner, vllm_runner
from .model_config import HEAD_CHOICES_DOC, deepseek_v3_config, shared_config_dir

HOSTILE = "hostile"
# Seconds planned for what is not the load itself, as seen on an H100 with every compile cache empty.
# load_start_s: from the command's start to the load engine's first request. vLLM: process start, torch.compile, CUDA
# graphs, the MTP drafter and a warm-up request, 170 s. SGLang: the target's CUDA graphs up to batch 64 (the first
# capture builds the MoE's Triton kernels: 100 s), then the EAGLE draft's: still capturing at 228 s.
# forced_s: the reference's eager start and forcing (on an H200 with warm caches, forcing the survivors of two
# loads: vLLM 120 s, SGLang 158 s). second_load_start_s: the baseline's load engine, which finds the caches the first
# one filled (vLLM: 55-80 s). The requests in flight when sending stops get the load's drain_s; an engine that starts
# slower than planned sends for less (hostile_load.sending_window).
ENGINES = {
    "vllm": {"runner": "mla_backend.serve_bench.hostile_vllm",
             "backends": (vllm_runner.ENGINE.ours, "FLASHMLA", "FLASH_ATTN_MLA"),
             "kv": vllm_runner.ENGINE.kv_cache_dtypes, "load_start_s": 180.0,
             "second_load_start_s": 90.0, "forced_s": 130.0},
    "sglang": {"runner": "mla_backend.serve_bench.hostile_sglang",
               "backends": (sglang_runner.ENGINE.ours, "flashmla", "triton"),
               "kv": sglang_runner.ENGINE.kv_cache_dtypes, "load_start_s": 300.0,
               "second_load_start_s": 150.0, "forced_s": 170.0},
}
KILL_GRACE_S = 30.0  # past its deadline a process gets this long to write its results
MIN_SENDING_S = 20.0  # the least sending a --budget must leave after the load engine's start


def selected(argv: list[str]) -> bool:
    """Whether a serve-bench command line asks for the hostile workload (then :func:`main` takes it)."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--workloads" and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--workloads=") else None)
        if value is not None and HOSTILE in [w.strip() for w in value.split(",")]:
            return True
    return False


def build_parser() -> argparse.ArgumentParser:
    defaults = HostileLoad()
    p = argparse.ArgumentParser(prog="mla-backend serve-bench --workloads hostile",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--workloads", required=True, help="hostile (alone)")
    p.add_argument("--backends", help="OURS,REFERENCE[,BASELINE] (REFERENCE forces, BASELINE serves the load too); "
                   "vLLM default " + ",".join(ENGINES["vllm"]["backends"])
                   + ", SGLang " + ",".join(ENGINES["sglang"]["backends"]))
    p.add_argument("--duration", type=float, help="most seconds of sending (default: what --budget leaves)")
    p.add_argument("--budget", type=float, default=600.0, help="seconds for the whole command, every engine included")
    p.add_argument("--mtp", choices=("on", "off"), default="on", help="one MTP draft token (vLLM mtp, SGLang EAGLE)")
    p.add_argument("--max-context", type=int, default=defaults.max_context, help="longest prompt + output")
    p.add_argument("--max-output", type=int, default=defaults.max_output, help="most tokens one request generates")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV-pool tokens (0: 3 x max context)")
    p.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens, help="prefill chunk")
    p.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency)
    p.add_argument("--phase-seconds", type=float, default=defaults.phase_s, help="concurrency changes this often")
    p.add_argument("--prefix-share", type=float, default=defaults.prefix_share)
    p.add_argument("--abort-share", type=float, default=defaults.abort_share)
    p.add_argument("--forced-requests", type=int, default=defaults.forced_requests,
                   help="most survivors re-run teacher-forced")
    p.add_argument("--agreement-margin", type=float, default=hostile_report.DEFAULT_AGREEMENT_MARGIN,
                   help="ours may agree this much less than the baseline (or 3 standard errors, if more)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=16, help=f"query heads: {HEAD_CHOICES_DOC}")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.85)
    p.add_argument("--out-dir", default="serve_bench_results")
    p.add_argument("--dry-run", action="store_true", help="print the load and the first requests; run nothing")
    return p


def resolve(args: argparse.Namespace) -> tuple[HostileLoad, tuple[str, ...], dict]:
    """The load, the backends and the model's config.json contents; ValueError names the argument, its value and
    what is supported."""
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if workloads != [HOSTILE]:
        raise ValueError(f"--workloads {args.workloads!r}: hostile runs alone; give the other workloads their own "
                         "serve-bench command")
    engine = ENGINES[args.engine]
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip()) if args.backends else engine["backends"]
    backends = tuple(b.upper() if args.engine == "vllm" else b.lower() for b in backends)
    if not 1 <= len(backends) <= 3:
        raise ValueError(f"--backends {args.backends!r}: give 1 to 3 backends (ours, reference, baseline)")
    model_config = deepseek_v3_config(args.heads, args.layers)  # raises on impossible shapes
    # Sending ends at --duration or where the budget says (hostile_load.sending_window), whichever comes first, so
    # the budget only has to fit what follows the load engine's start; the default is all that the budget leaves.
    loads = load_engines(len(backends))
    besides = reserve_s(args.engine, len(backends)) - ENGINES[args.engine]["load_start_s"]
    most = (args.budget - besides) / loads
    if most < MIN_SENDING_S:
        raise ValueError(f"--budget {args.budget:.0f}: the engines need {besides:.0f} s besides the first load "
                         f"engine's start and {loads} x the sending; give --budget >= "
                         f"{besides + loads * MIN_SENDING_S:.0f} plus that start (planned: "
                         f"{ENGINES[args.engine]['load_start_s']:.0f} s with every compile cache empty)")
    if args.duration is not None and not args.duration > 0:
        raise ValueError(f"--duration {args.duration}: give a positive number of seconds")
    duration = args.duration if args.duration is not None else most
    load = HostileLoad(seconds=duration, max_context=args.max_context, max_output=args.max_output,
                       kv_tokens=args.kv_tokens, chunk_tokens=args.chunk_tokens, max_concurrency=args.max_concurrency,
                       phase_s=args.phase_seconds, prefix_share=args.prefix_share, abort_share=args.abort_share,
                       mtp=args.mtp == "on", forced_requests=args.forced_requests, seed=args.seed)
    check_load(load)
    return load, backends, model_config


def load_engines(backends: int) -> int:
    """How many engines serve the load: ours, and with three backends the baseline too (the second only forces)."""
    return 2 if backends == 3 else 1


def reserve_s(engine: str, backends: int) -> float:
    """Seconds of ``--budget`` that are not sending: the engines' starts and drains, the forcing and the grace."""
    plan, drain = ENGINES[engine], HostileLoad().drain_s
    second = plan["second_load_start_s"] + drain if load_engines(backends) == 2 else 0.0
    return plan["load_start_s"] + drain + second + plan["forced_s"] * (backends > 1) + KILL_GRACE_S


def describe(load: HostileLoad, backends: tuple[str, ...], vocab_size: int, requests: int = 12) -> list[str]:
    prefixes = shared_prefixes(load, vocab_size)
    schedule = concurrency_schedule(load)
    baseline = f", then {backends[2]} (baseline)" if len(backends) > 2 else ""
    lines = [f"backends: under load {backends[0]} (ours){baseline}; forcing both: "
             f"{backends[1] if len(backends) > 1 else 'none'} (reference)",
             f"load: up to {load.seconds:.0f} s of sending, max context {load.max_context}, KV pool "
             f"{load.pool_tokens} tokens, prefill chunk {load.chunk_tokens}, MTP {'on' if load.mtp else 'off'}, "
             f"seed {load.seed}",
             f"shared prefixes: {[len(p) for p in prefixes]} tokens; concurrency every {load.phase_s:g} s: "
             f"{[level for _, level in schedule][:24]}{' ...' if len(schedule) > 24 else ''}",
             f"{'request':>8}{'prompt':>8}{'output':>8}{'abort at':>10}{'prefix':>8}"]
    for index in range(requests):
        plan = plan_request(load, vocab_size, index, prefixes)
        lines.append(f"{index:>8}{len(plan.prompt):>8}{plan.max_tokens:>8}{_dash(plan.abort_after):>10}"
                     f"{_dash(plan.prefix_group):>8}")
    return lines


def _dash(value) -> str:
    return "-" if value is None else str(value)


def run_phase(engine: str, mode: str, backend: str, load: HostileLoad, args, model_dir: Path, vocab_size: int,
              work: Path, out_dir: Path, deadline: float, sequences: Path | None = None, later_loads: int = 0) -> dict:
    """One engine process; returns its result file (or why there is none)."""
    from .driver import run_engine  # the serve-bench driver's process handling (process group, kill, result)

    name = f"{mode}-{backend}"
    spec = HostileSpec(mode=mode, engine=engine, backend=backend, model_dir=str(model_dir),
                       vocab_size=vocab_size, load=load_to_dict(load),
                       result_path=str(work / f"{name}.result.json"), log_path=str(out_dir / f"hostile-{name}.log"),
                       kv_cache_dtype=ENGINES[engine]["kv"][args.kv_cache_dtype],
                       gpu_memory_fraction=args.gpu_memory_fraction,
                       sequences_path=str(sequences) if sequences else "", deadline=deadline,
                       later_loads=later_loads, later_start_s=ENGINES[engine]["second_load_start_s"])
    print(f"[hostile] {mode} on {backend}: engine starting (log: {spec.log_path})", flush=True)
    result = run_engine(spec, ENGINES[engine]["runner"], work / f"{name}.spec.json",
                        deadline + KILL_GRACE_S - time.time())
    print(f"[hostile] {mode} on {backend}: {result.get('status')} in {result.get('wall_s', 0):.0f} s"
          + (f"; {result['error']}" if result.get("error") else ""), flush=True)
    return result


def run(args, load: HostileLoad, backends: tuple[str, ...], model_config: dict, out_dir: Path) -> dict:
    """Ours serves the load; with three backends the baseline serves it next, for as long as ours sent; the
    reference then forces both engines' survivors (interleaved, so that a cut-off forcing keeps both)."""
    start = time.time()
    end = start + args.budget
    reference = backends[1] if len(backends) > 1 else None
    baseline = backends[2] if len(backends) > 2 else None
    with tempfile.TemporaryDirectory(prefix="hostile_") as tmp:
        work = Path(tmp)
        model_dir = shared_config_dir(model_config, fallback=work / "model")
        vocab_size = model_config["vocab_size"]
        loads_deadline = end - KILL_GRACE_S - (ENGINES[args.engine]["forced_s"] if reference else 0.0)
        phase = dict(args=args, model_dir=model_dir, vocab_size=vocab_size, work=work, out_dir=out_dir)
        load_result = run_phase(args.engine, LOAD, backends[0], load, deadline=loads_deadline,
                                later_loads=int(baseline is not None), **phase)
        sources = {"ours": forced_selection(load_result.get("records", []), load.forced_requests)}
        baseline_result = reference_result = None
        if baseline:
            sent = load_result.get("sent_s")
            sent = load.seconds if sent is None else sent  # no result file: as planned
            baseline_result = run_phase(args.engine, LOAD, baseline, dataclasses.replace(load, seconds=max(1.0, sent)),
                                        deadline=loads_deadline, **phase)
            sources["baseline"] = forced_selection(baseline_result.get("records", []), load.forced_requests)
        if reference:
            sequences = work / "survivors.json"
            sequences.write_text(json.dumps(interleave(sources)))
            reference_result = (run_phase(args.engine, FORCED, reference, load, deadline=end - KILL_GRACE_S,
                                          sequences=sequences, **phase)
                                if sources["ours"] else {"status": "skipped", "error": "no completed request to force"})
    summary = hostile_report.summarize(load_result, reference and (reference, reference_result),
                                       baseline and (baseline, baseline_result), args.agreement_margin)
    engine_info = load_result.get("engine_info", {})
    return {"engine": args.engine, "engine_version": engine_info.get(args.engine), "ours": backends[0],
            "backends": list(backends), "load": load_to_dict(load), "summary": summary,
            "load_engine": _without(load_result, "records"),
            "baseline_engine": baseline_result and _without(baseline_result, "records"),
            "forced_engine": reference_result and _without(reference_result, "argmax"),
            "records": load_result.get("records", []),
            "baseline_records": (baseline_result or {}).get("records", []),
            "argmax": (reference_result or {}).get("argmax"),
            "wall_s": round(time.time() - start, 1), "command": "mla-backend serve-bench " + " ".join(sys.argv[2:])}


def interleave(sources: dict[str, list[dict]]) -> list[dict]:
    """The survivors of each source as forced-mode sequences, alternating between the sources."""
    tagged = [[{"source": source, "index": r["index"], "output": r["output"]} for r in records]
              for source, records in sources.items()]
    return [s for group in itertools.zip_longest(*tagged) for s in group if s is not None]


def _without(result: dict, key: str) -> dict:
    return {k: v for k, v in result.items() if k != key}


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        load, backends, model_config = resolve(args)
    except ValueError as e:
        parser.error(str(e))
    cold = min(load.seconds, (args.budget - reserve_s(args.engine, len(backends))) / load_engines(len(backends)))
    print(f"[hostile] sending for up to {load.seconds:.0f} s; {max(0.0, cold):.0f} s if the load engine takes the "
          f"{ENGINES[args.engine]['load_start_s']:.0f} s to start that it takes with every compile cache empty"
          + ("" if cold >= MIN_SENDING_S else " (warm the caches first: mla-backend compile, or one serve-bench run)"),
          flush=True)
    if args.dry_run:
        print("\n".join(describe(load, backends, model_config["vocab_size"])))
        return 0
    from ..cli import NOTHING_RAN, nothing_ran
    from .driver import run_blocker

    blocker = run_blocker(args.engine)
    if blocker:
        return nothing_ran("serve-bench", f"{blocker}; the hostile load cannot run (--dry-run lists it).")
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run(args, load, backends, model_config, out_dir)
    files = hostile_report.write_outputs(out_dir, report)
    print("\n" + hostile_report.markdown(report))
    print(f"[hostile] wrote {', '.join(files)}")
    if not report["summary"]["counts"]["sent"]:
        return NOTHING_RAN
    return 0 if report["summary"]["passed"] else 1
