#!/usr/bin/env python3
"""GPU end-to-end checks of the vLLM plugin (attention backend CUSTOM) on a tiny DeepSeek-V3 model.

Run on a Hopper GPU with vllm 0.26 and this package installed (the entry point must be visible:
``pip install -e .``). Each engine runs in a fresh subprocess, so GPU memory is freed between engines.
Engine starts take 75-110 s; pick at most ~4 engines per invocation to stay under 9 minutes.

    python tests/e2e/vllm_e2e.py --cases block64,block16 --out /tmp/e2e.json    # 4 engines
    python tests/e2e/vllm_e2e.py --cases graphs,mtp --out /tmp/e2e2.json        # 4 engines (CUSTOM/64 shared)
    python tests/e2e/vllm_e2e.py --cases fp8,mtp3 --out /tmp/e2e3.json
    python tests/e2e/vllm_e2e.py --cases forced,forced_baseline --out /tmp/e2e4.json  # teacher-forced, 3 engines
    python tests/e2e/vllm_e2e.py --cases forced_fp8c,forced_fp8c_flashmla,forced_fp8_baseline --heads 128 \
        --out /tmp/e2e5.json                                                    # fp8 compute, 3 engines
    python tests/e2e/vllm_e2e.py --serve --out /tmp/serve.json                  # vllm serve, 1 engine
    python tests/e2e/vllm_e2e.py --throughput --out /tmp/tput.json              # 3 engines

Comparisons: greedy token ids of ~8 ragged token-id prompts, CUSTOM against a built-in MLA backend
(same block size, same weights). Weights are random, so logits have near ties and some divergence is
numerics, not a bug. By default the weights are a *scaled* random init (std 1/sqrt(fan_in), norms 1,
through a registered load format in an in-process engine) rather than vLLM's ``dummy`` U(-1e-3, 1e-3),
whose logits are almost flat; ``--init dummy`` uses vLLM's own. Pass: the first 8 tokens agree for
>= 75% of the prompts and >= 90% of all generated tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "tiny_dsv3" / "config.json"
SCALED_LOAD_FORMAT = "mla_e2e_scaled_dummy"
PROMPT_LENS = (1, 7, 63, 65, 200, 513, 1000, 1500)
FIRST_K = 8
MIN_FIRST_K_PROMPTS = 0.75
MIN_TOKEN_MATCH = 0.90
ENGINE_ESTIMATE_S = 150  # start (compile, CUDA graphs, first TileLang compile) + generate, before one has run


def engine(backend: str, block_size: int, **kw) -> dict:
    return dict(backend=backend, block_size=block_size, **kw)


# name -> (what it checks, CUSTOM engine, reference engine)
CASES = {
    "block64": ("CUSTOM vs FLASHMLA, block 64, bf16 KV",
                engine("CUSTOM", 64), engine("FLASHMLA", 64)),
    "block16": ("CUSTOM vs TRITON_MLA, block 16 (vLLM's default), bf16 KV",
                engine("CUSTOM", 16), engine("TRITON_MLA", 16)),
    "mtp": ("MTP, 1 draft (decode q_len 2), target and draft on CUSTOM vs on FLASHMLA, block 64",
            engine("CUSTOM", 64, num_spec=1), engine("FLASHMLA", 64, num_spec=1)),
    "mtp3": ("MTP, 3 drafts (decode q_len 4), CUSTOM vs FLASHMLA, block 64",
             engine("CUSTOM", 64, num_spec=3), engine("FLASHMLA", 64, num_spec=3)),
    "fp8": ("fp8 KV cache, CUSTOM vs TRITON_MLA (both keep q in bf16: MLA_BACKEND_FP8_COMPUTE=0), block 64",
            engine("CUSTOM", 64, kv_cache_dtype="fp8", fp8_compute=False),
            engine("TRITON_MLA", 64, kv_cache_dtype="fp8")),
    "verify": ("every CUSTOM decode call (eager, block 16) recomputed by the fp32 reference inside the engine "
               "(MLA_BACKEND_VERIFY=1); tokens vs TRITON_MLA eager shown for information",
               engine("CUSTOM", 16, eager=True, verify=True), engine("TRITON_MLA", 16, eager=True)),
    "mtp_verify": ("MTP, 1 draft: every CUSTOM decode call (eager, block 64, q_len 2 for verification) recomputed by "
                   "the fp32 reference inside the engine. vLLM 0.26 refuses custom logits processors with speculative "
                   "decoding, so teacher forcing is not available here; tokens vs FLASHMLA (eager, MTP) for information",
                   engine("CUSTOM", 64, eager=True, verify=True, num_spec=1),
                   engine("FLASHMLA", 64, eager=True, num_spec=1)),
    "baseline": ("two built-in backends against each other (FLASHMLA vs TRITON_MLA, block 64): how far correct "
                 "kernels drift apart on this random model, to read the CUSTOM rows against",
                 engine("FLASHMLA", 64), engine("TRITON_MLA", 64)),
    "pages": ("CUSTOM block 16 vs CUSTOM block 64: the same kernel on different page tables (identical tokens "
              "where the engine reproduces itself)", engine("CUSTOM", 16), engine("CUSTOM", 64)),
    "forced": ("teacher-forced decode: both engines are made to emit the same random token sequence (a logits "
               "processor), so every step sees the same context; compares each step's own argmax (raw logits) "
               "instead of free-running tokens, whose first near-tie divergence changes every later context",
               engine("CUSTOM", 64, forced=True), engine("FLASHMLA", 64, forced=True)),
    "forced16": ("teacher-forced decode (see forced), block 16",
                 engine("CUSTOM", 16, forced=True), engine("TRITON_MLA", 16, forced=True)),
    "forced_fp8": ("teacher-forced decode (see forced), fp8 KV cache: CUSTOM vs TRITON_MLA (both keep q in bf16: "
                   "MLA_BACKEND_FP8_COMPUTE=0), block 64; read against forced_baseline",
                   engine("CUSTOM", 64, kv_cache_dtype="fp8", forced=True, fp8_compute=False),
                   engine("TRITON_MLA", 64, kv_cache_dtype="fp8", forced=True)),
    "forced_fp8c": ("teacher-forced decode, fp8 KV cache: CUSTOM with fp8 compute (the default; q quantised per "
                    "(token, head) row from 17 rows, e4m3 products) vs TRITON_MLA (q in bf16), block 64; read against "
                    "forced_fp8_baseline", engine("CUSTOM", 64, kv_cache_dtype="fp8", forced=True, fp8_compute=True),
                    engine("TRITON_MLA", 64, kv_cache_dtype="fp8", forced=True)),
    "forced_baseline": ("teacher-forced decode, two built-in backends against each other (FLASHMLA vs TRITON_MLA)",
                        engine("FLASHMLA", 64, forced=True), engine("TRITON_MLA", 64, forced=True)),
    "forced_fp8c_flashmla": ("teacher-forced decode, fp8 KV cache: CUSTOM with fp8 compute (the default) vs FLASHMLA, "
                             "both quantising q to e4m3 (CUSTOM per (token, head) row from 17 rows, FLASHMLA per "
                             "tensor); read against forced_fp8_baseline",
                             engine("CUSTOM", 64, kv_cache_dtype="fp8", forced=True, fp8_compute=True),
                             engine("FLASHMLA", 64, kv_cache_dtype="fp8", forced=True)),
    "forced_fp8_baseline": ("teacher-forced decode, fp8 KV cache, two built-ins against each other: FLASHMLA (q "
                            "quantised to fp8, e4m3 products) vs TRITON_MLA (q in bf16); the anchor for an fp8 path "
                            "that quantises q", engine("FLASHMLA", 64, kv_cache_dtype="fp8", forced=True),
                            engine("TRITON_MLA", 64, kv_cache_dtype="fp8", forced=True)),
    "graphs": ("CUSTOM with full CUDA graphs (default) vs CUSTOM with attention outside graphs (PIECEWISE): "
               "checks that graph replays read refreshed metadata",
               engine("CUSTOM", 64), engine("CUSTOM", 64, cudagraph_mode="PIECEWISE")),
    "forced_graphs": ("teacher-forced decode (see forced), CUSTOM with full CUDA graphs vs CUSTOM with attention "
                      "outside graphs (PIECEWISE): every step's metadata and split plan are refreshed before the "
                      "replay; the forced tokens' logprobs must agree closely, not only the argmax",
                      engine("CUSTOM", 64, forced=True),
                      engine("CUSTOM", 64, cudagraph_mode="PIECEWISE", forced=True)),
}
DEFAULT_CASES = "block64,block16"
THROUGHPUT_BACKENDS = ("CUSTOM", "FLASHMLA", "FLASH_ATTN_MLA")


# ---------------------------------------------------------------------------------------------- helpers
def make_prompts(lens, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]  # 0/1 are bos/eos


def write_model_dir(root: Path, heads: int | None = None) -> Path:
    """The tiny model's config; ``heads``: its attention heads instead of 16 (128: DeepSeek-V3's at TP1, which runs
    the Hopper kernel's row-block pairs)."""
    d = root / "tiny_dsv3"
    d.mkdir(parents=True, exist_ok=True)
    if heads is None:
        shutil.copyfile(CONFIG, d / "config.json")
    else:
        config = json.loads(CONFIG.read_text())
        config["num_attention_heads"] = config["num_key_value_heads"] = heads
        (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


def vocab_size() -> int:
    return json.loads(CONFIG.read_text())["vocab_size"]


def engine_key(spec: dict) -> str:
    return json.dumps({k: spec[k] for k in sorted(spec) if k not in ("prompts",)}, sort_keys=True)


def engine_label(spec: dict) -> str:
    parts = [spec["backend"], f"b{spec['block_size']}"]
    if spec.get("kv_cache_dtype", "auto") != "auto":
        parts.append(spec["kv_cache_dtype"])
    if spec.get("num_spec"):
        parts.append(f"mtp{spec['num_spec']}")
    if spec.get("cudagraph_mode"):
        parts.append(spec["cudagraph_mode"].lower())
    if spec.get("eager"):
        parts.append("eager")
    if spec.get("verify"):
        parts.append("verify")
    if spec.get("fp8_compute") is not None:
        parts.append("fp8c" if spec["fp8_compute"] else "q16")
    if spec.get("forced"):
        parts.append("forced")
    return "-".join(parts)


# ---------------------------------------------------------------------------------------------- engine child
def register_scaled_loader() -> None:
    """The scaled random init (``mla_backend.serve_bench.random_weights``) as this script's load format."""
    from mla_backend.serve_bench.random_weights import register_vllm_scaled_loader

    register_vllm_scaled_loader(SCALED_LOAD_FORMAT)


def engine_kwargs(spec: dict, model_dir: str) -> dict:
    kw = dict(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              load_format=SCALED_LOAD_FORMAT if spec["init"] == "scaled" else "dummy",
              attention_backend=spec["backend"], block_size=spec["block_size"],
              kv_cache_dtype=spec.get("kv_cache_dtype", "auto"), gpu_memory_utilization=spec["gpu_mem"],
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"])
    if spec.get("num_spec"):
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec["num_spec"],
                                    # the drafter auto-selects its backend unless told
                                    "attention_backend": spec["backend"]}
    if spec.get("cudagraph_mode"):
        kw["compilation_config"] = {"cudagraph_mode": spec["cudagraph_mode"]}
    if spec.get("eager"):
        kw["enforce_eager"] = True
    if spec.get("forced"):
        from mla_backend.serve_bench.vllm_forcing import FORCE_TOKENS

        kw["logits_processors"] = [FORCE_TOKENS]
    return kw


def engine_main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("verify"):  # read when mla_backend.verify is imported: before anything imports the package
        os.environ["MLA_BACKEND_VERIFY"] = "1"
    if spec.get("fp8_compute") is not None:  # else the plugin's default
        os.environ["MLA_BACKEND_FP8_COMPUTE"] = "1" if spec["fp8_compute"] else "0"
    if spec["init"] == "scaled":
        # The custom load format must be registered where the model loads: keep the engine in-process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mla_backend.serve_bench.hostile_vllm import rank1_tokens

    if spec["init"] == "scaled":
        register_scaled_loader()
    result: dict = {"label": engine_label(spec), "vllm": vllm.__version__, "torch": torch.__version__}
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(spec, spec["model_dir"]))
    result["start_s"] = round(time.perf_counter() - t0, 1)
    result["device"] = torch.cuda.get_device_name(0)  # after LLM(): CUDA untouched before the engine forks
    try:
        cfg = llm.llm_engine.vllm_config
        result["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
        result["block_size"] = cfg.cache_config.block_size
    except Exception as e:  # introspection only
        result["introspection_error"] = repr(e)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if spec.get("forced"):
        forced = make_prompts([spec["max_tokens"]] * len(prompts), vocab_size(), seed=7)
        params = [SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=1,
                                 extra_args={"force_tokens": f}) for f in forced]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    if spec.get("forced"):
        # compare the model's own choice at each step (rank 1 of the raw logprobs), not the forced tokens
        result["forcing_held"] = tokens == forced
        result["forced_logprobs"] = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, f)]
                                     for o, f in zip(outputs, forced)]
        tokens = [rank1_tokens(o.outputs[0].logprobs, 0, len(o.outputs[0].logprobs)) for o in outputs]
    n_out = sum(len(t) for t in tokens)
    result.update(gen_s=round(gen_s, 3), output_tokens=n_out, output_tok_per_s=round(n_out / gen_s, 1),
                  total_tok_per_s=round((n_out + sum(len(p) for p in spec["prompts"])) / gen_s, 1))
    if spec.get("keep_tokens", True):
        result["tokens"] = tokens
    if spec["backend"] == "CUSTOM":
        try:  # what our op did in this process (in-process engines only)
            from mla_backend import dispatch
            from mla_backend.kernels import runtime

            result["mla_backend_calls"] = sorted(str(k) for k in dispatch._LOGGED)
            result["mla_backend_kernels"] = [str(v) for v in runtime.STATS.variants]
            from mla_backend.op import VERIFY

            result["mla_backend_verify"] = dict(VERIFY)
        except Exception as e:
            result["introspection_error"] = repr(e)
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip engine teardown (it can hang); the parent kills what is left of the process group


def run_engine(spec: dict, workdir: Path, log_dir: Path, timeout: int) -> dict:
    label = engine_label(spec)
    spec_path, result_path = workdir / f"{label}.spec.json", workdir / f"{label}.result.json"
    spec_path.write_text(json.dumps(spec))
    log_path = log_dir / f"{label}.log"
    print(f"[e2e] engine {label} starting (log: {log_path})", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_engine", str(spec_path),
                                 "--_result", str(result_path)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc = "timeout"
        _kill_stragglers(proc)  # e.g. an engine-core process: free the GPU before the next engine
    wall = round(time.perf_counter() - t0, 1)
    if result_path.exists():
        result = json.loads(result_path.read_text())
        result["wall_s"] = wall
        print(f"[e2e] engine {label} done in {wall}s (start {result.get('start_s')}s, "
              f"{result.get('output_tok_per_s')} out tok/s)", flush=True)
        return result
    tail = log_path.read_text()[-3000:] if log_path.exists() else ""
    print(f"[e2e] engine {label} FAILED (rc={rc}) after {wall}s; log tail:\n{tail}", flush=True)
    return {"label": label, "error": f"rc={rc}", "wall_s": wall, "log_tail": tail}


def _kill_stragglers(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(3)  # let the driver release the GPU memory
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


# ---------------------------------------------------------------------------------------------- comparison
def compare(a: list[list[int]], b: list[list[int]], prompt_lens) -> dict:
    rows, matched, total, first_ok = [], 0, 0, 0
    for n, ta, tb in zip(prompt_lens, a, b):
        length = max(len(ta), len(tb))
        same = sum(x == y for x, y in zip(ta, tb))
        div = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if div is None and len(ta) != len(tb):
            div = min(len(ta), len(tb))
        ok_k = div is None or div >= FIRST_K
        rows.append({"prompt_len": n, "match": round(same / max(length, 1), 3), "first_divergence": div,
                     "first8_equal": ok_k})
        matched, total, first_ok = matched + same, total + length, first_ok + ok_k
    token_match = matched / max(total, 1)
    first_frac = first_ok / max(len(rows), 1)
    passed = first_frac >= MIN_FIRST_K_PROMPTS and token_match >= MIN_TOKEN_MATCH
    return {"rows": rows, "token_match": round(token_match, 4), "first8_prompts": round(first_frac, 3),
            "passed": passed}


def print_case(name: str, desc: str, la: str, lb: str, cmp: dict) -> None:
    print(f"\n=== {name}: {desc}\n    {la}  vs  {lb}")
    print(f"    {'prompt_len':>10} {'match':>7} {'first_div':>9} {'first8':>6}")
    for r in cmp["rows"]:
        div = "-" if r["first_divergence"] is None else r["first_divergence"]
        print(f"    {r['prompt_len']:>10} {r['match']:>7.1%} {div!s:>9} {'yes' if r['first8_equal'] else 'NO':>6}")
    print(f"    tokens matching: {cmp['token_match']:.1%} (need >= {MIN_TOKEN_MATCH:.0%}); first {FIRST_K} equal in "
          f"{cmp['first8_prompts']:.0%} of prompts (need >= {MIN_FIRST_K_PROMPTS:.0%}) -> "
          f"{'PASS' if cmp['passed'] else 'FAIL'}", flush=True)


def base_spec(args, model_dir: Path, prompts, max_tokens: int, max_num_seqs: int, init: str) -> dict:
    return dict(model_dir=str(model_dir), init=init, gpu_mem=args.gpu_mem, max_model_len=args.max_model_len,
                max_num_seqs=max_num_seqs, max_tokens=max_tokens, prompts=prompts)


def run_cases(args, workdir: Path, log_dir: Path, model_dir: Path) -> dict:
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    prompts = make_prompts(lens, vocab_size(), seed=0)
    base = base_spec(args, model_dir, prompts, args.max_tokens, args.max_num_seqs, args.init)
    engines: dict[str, dict] = {}
    report = {"mode": "cases", "init": args.init, "prompt_lens": lens, "max_tokens": args.max_tokens,
              "cases": {}, "engines": {}}
    t0 = time.perf_counter()
    for name in names:
        desc, ea, eb = CASES[name]
        specs = [{**base, **e} for e in (ea, eb)]
        new = [s for s in specs if engine_key(s) not in engines]
        walls = [r.get("wall_s", 0) for r in engines.values()]
        estimate = len(new) * (max(walls) if walls else ENGINE_ESTIMATE_S)
        if engines and time.perf_counter() - t0 + estimate > args.budget:  # the first case always runs
            print(f"\n=== {name}: SKIPPED, {len(new)} more engine(s) (~{estimate:.0f}s) would pass the "
                  f"{args.budget}s budget; run it in another invocation: --cases {name}", flush=True)
            report["cases"][name] = {"description": desc, "skipped": "time budget", "passed": None}
            continue
        results = []
        for spec in specs:
            key = engine_key(spec)
            if key not in engines:
                engines[key] = run_engine(spec, workdir, log_dir, args.engine_timeout)
            results.append(engines[key])
        ra, rb = results
        entry = {"description": desc, "a": ra["label"], "b": rb["label"]}
        if "tokens" in ra and "tokens" in rb:
            entry.update(compare(ra["tokens"], rb["tokens"], lens))
            if "forced_logprobs" in ra and "forced_logprobs" in rb:
                diffs = [abs(x - y) for pa, pb in zip(ra["forced_logprobs"], rb["forced_logprobs"])
                         for x, y in zip(pa, pb)]
                entry["forcing_held"] = bool(ra.get("forcing_held") and rb.get("forcing_held"))
                entry["forced_logprob_abs_diff"] = {"max": round(max(diffs), 4),
                                                    "mean": round(sum(diffs) / len(diffs), 5)}
                entry["passed"] = entry["passed"] and entry["forcing_held"]
            entry["tokens"] = {ra["label"]: ra["tokens"], rb["label"]: rb["tokens"]}
            print_case(name, desc, ra["label"], rb["label"], entry)
            if "forcing_held" in entry:
                print(f"    forcing held: {entry['forcing_held']}; |logprob difference| of the forced tokens: "
                      f"max {entry['forced_logprob_abs_diff']['max']}, mean {entry['forced_logprob_abs_diff']['mean']}",
                      flush=True)
            if name in ("pages", "graphs"):
                # Same kernel and numerics, yet the engine is not bit-reproducible from one process to the next
                # (docs/vllm.md): identity is reported, the pass is the agreement rule above. Stale metadata in a
                # replay breaks that rule from the first steps; tests/test_vllm_builder_gpu.py checks the bits.
                entry["identical"] = ra["tokens"] == rb["tokens"]
                print(f"    identical tokens: {entry['identical']}", flush=True)
            if name in ("verify", "mtp_verify"):
                v = ra.get("mla_backend_verify", {})
                entry["verify"] = v
                entry["passed"] = v.get("calls", 0) > 0 and v["max_rel_err"] < 2e-2 and v["max_lse_err"] < 1e-2
                if name == "mtp_verify":  # the q_len 2 (draft verification) calls must be among those checked
                    entry["passed"] = entry["passed"] and v.get("calls_by_q_len", {}).get("2", 0) > 0
                print(f"    in-engine check of {v.get('calls', 0)} decode calls (by q_len: "
                      f"{v.get('calls_by_q_len', {})}): max rel err {v.get('max_rel_err', float('nan')):.2e}, "
                      f"max LSE err {v.get('max_lse_err', float('nan')):.2e} -> {'PASS' if entry['passed'] else 'FAIL'}",
                      flush=True)
        else:
            entry.update(passed=False, error=ra.get("error") or rb.get("error"))
            print(f"\n=== {name}: {desc}\n    ERROR: {entry['error']}", flush=True)
        report["cases"][name] = entry
    report["engines"] = {r["label"]: {k: v for k, v in r.items() if k != "tokens"} for r in engines.values()}
    ran = [c["passed"] for c in report["cases"].values() if c["passed"] is not None]
    report["passed"] = bool(ran) and all(ran)
    report["skipped"] = [n for n, c in report["cases"].items() if c["passed"] is None]
    return report


# ---------------------------------------------------------------------------------------------- serve
def _http(method: str, url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
            try:
                return resp.status, json.loads(text)
            except json.JSONDecodeError:
                return resp.status, text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:2000]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(args, log_dir: Path, model_dir: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
           "--attention-backend", args.serve_backend, "--load-format", "dummy", "--skip-tokenizer-init",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny", "--seed", "0",
           "--block-size", str(args.serve_block_size), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.gpu_mem)]
    log_path = log_dir / f"serve-{args.serve_backend}.log"
    print(f"[e2e] {' '.join(cmd)}\n[e2e] server log: {log_path}", flush=True)
    report: dict = {"mode": "serve", "backend": args.serve_backend, "cmd": cmd, "passed": False}
    t0 = time.perf_counter()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while time.perf_counter() - t0 < args.engine_timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with rc={proc.returncode}")
            try:
                if _http("GET", base + "/health", timeout=5)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(2)
        else:
            raise RuntimeError(f"server not healthy after {args.engine_timeout}s")
        report["start_s"] = round(time.perf_counter() - t0, 1)
        print(f"[e2e] server healthy after {report['start_s']}s", flush=True)
        lens = [int(x) for x in args.prompt_lens.split(",")]
        prompts = make_prompts(lens, vocab_size(), seed=0)
        vocab = vocab_size()

        def complete(p):
            return _http("POST", base + "/v1/completions",
                         {"model": "tiny", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                          "ignore_eos": True, "return_token_ids": True}, timeout=120)

        t1 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the server batches them
            responses = list(pool.map(complete, prompts))
        report["requests_s"] = round(time.perf_counter() - t1, 2)
        again = complete(prompts[0])  # alone, for a determinism check
        rows, ok = [], True
        for n, (status, body) in zip(lens, responses):
            ids = body["choices"][0].get("token_ids") if status == 200 and isinstance(body, dict) else None
            good = (isinstance(ids, list) and len(ids) == args.max_tokens
                    and all(isinstance(t, int) and 0 <= t < vocab for t in ids))
            ok &= good
            rows.append({"prompt_len": n, "status": status, "num_tokens": len(ids) if ids else 0, "ok": good,
                         "first_tokens": ids[:8] if ids else str(body)[:300]})
        same_again = (again[0] == 200 and isinstance(again[1], dict) and isinstance(responses[0][1], dict)
                      and again[1]["choices"][0].get("token_ids") == responses[0][1]["choices"][0].get("token_ids"))
        report.update(rows=rows, repeat_identical=same_again, passed=ok)
        print(f"\n=== serve ({args.serve_backend}): {len(rows)} concurrent /v1/completions with token-id prompts")
        for r in rows:
            print(f"    len {r['prompt_len']:>5}: HTTP {r['status']} {r['num_tokens']} tokens "
                  f"{'ok' if r['ok'] else 'BAD'} {r['first_tokens']}")
        print(f"    repeated request gives the same tokens: {same_again} (informational)")
        print(f"    -> {'PASS' if ok else 'FAIL'}", flush=True)
    except Exception as e:
        report["error"] = repr(e)
        print(f"[e2e] serve FAILED: {e}", flush=True)
    finally:
        _kill_group(proc)
        _kill_stragglers(proc)
        log.close()
        report["log_tail"] = log_path.read_text()[-3000:]
        if not report["passed"]:
            print(report["log_tail"], flush=True)
    return report


# ---------------------------------------------------------------------------------------------- throughput
def run_throughput(args, workdir: Path, log_dir: Path, model_dir: Path) -> dict:
    prompts = make_prompts([args.tp_input_len] * args.tp_prompts, vocab_size(), seed=1)
    base = base_spec(args, model_dir, prompts, args.tp_output_len, args.tp_prompts, args.tp_init)
    base["keep_tokens"] = False
    report = {"mode": "throughput", "prompts": args.tp_prompts, "input_len": args.tp_input_len,
              "output_len": args.tp_output_len, "block_size": args.tp_block_size, "init": args.tp_init,
              "engines": {}}
    for backend in [b.strip() for b in args.tp_backends.split(",") if b.strip()]:
        spec = {**base, **engine(backend, args.tp_block_size)}
        r = run_engine(spec, workdir, log_dir, args.engine_timeout)
        report["engines"][backend] = r
    print(f"\n=== throughput: {args.tp_prompts} prompts x {args.tp_input_len} tokens in, {args.tp_output_len} out "
          f"(ignore_eos), block {args.tp_block_size}")
    print(f"    {'backend':<16} {'out tok/s':>10} {'total tok/s':>12} {'gen s':>7} {'start s':>8}")
    for backend, r in report["engines"].items():
        if "error" in r:
            print(f"    {backend:<16} ERROR {r['error']}")
        else:
            print(f"    {backend:<16} {r['output_tok_per_s']:>10.0f} {r['total_tok_per_s']:>12.0f} "
                  f"{r['gen_s']:>7.1f} {r['start_s']:>8.1f}")
    report["passed"] = all("error" not in r for r in report["engines"].values())
    return report


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--serve", action="store_true", help="vllm serve + /v1/completions instead of the cases")
    ap.add_argument("--throughput", action="store_true", help="throughput of CUSTOM vs built-in MLA backends")
    ap.add_argument("--out", default="vllm_e2e.json", help="results JSON (logs go beside it)")
    ap.add_argument("--init", choices=("scaled", "dummy"), default="scaled", help="random weights for the cases")
    ap.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--heads", type=int, help="attention heads of the tiny model (default: its config's 16)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="gpu_memory_utilization")
    ap.add_argument("--engine-timeout", type=int, default=300, help="seconds per engine (start + generate)")
    ap.add_argument("--budget", type=int, default=500,
                    help="seconds for the cases: a case whose engines would not fit is skipped (and named)")
    ap.add_argument("--serve-backend", default="CUSTOM")
    ap.add_argument("--serve-block-size", type=int, default=64)
    ap.add_argument("--tp-backends", default=",".join(THROUGHPUT_BACKENDS))
    ap.add_argument("--tp-prompts", type=int, default=256)
    ap.add_argument("--tp-input-len", type=int, default=512)
    ap.add_argument("--tp-output-len", type=int, default=512)
    ap.add_argument("--tp-block-size", type=int, default=64)
    ap.add_argument("--tp-init", choices=("scaled", "dummy"), default="dummy")
    ap.add_argument("--_engine", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._engine:
        engine_main(args._engine, args._result)
        return 0

    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / f"{out.stem}-logs"
    log_dir.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vllm_e2e_") as tmp:
        workdir = Path(tmp)
        model_dir = write_model_dir(workdir, args.heads)
        if args.serve:
            report = run_serve(args, log_dir, model_dir)
        elif args.throughput:
            report = run_throughput(args, workdir, log_dir, model_dir)
        else:
            report = run_cases(args, workdir, log_dir, model_dir)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(report, indent=1))
    skipped = f"; not run: {','.join(report['skipped'])}" if report.get("skipped") else ""
    print(f"\n[e2e] {'PASS' if report.get('passed') else 'FAIL'} in {report['wall_s']}s{skipped}; results: {out}",
          flush=True)
    return 0 if report.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
