"""``mla-backend serve-bench``: served speed of every attention backend of one engine, one engine start each.

    mla-backend serve-bench --engine vllm|sglang [--backends ...] [--workloads decode,throughput,mixed]
        [--model small-moe|deepseek-v3] [--heads 16] [--layers 8] [--repeats 3] [--kv-cache-dtype auto|fp8]
        [--tensor-parallel-size N] [--dp-attention] [--speculative-tokens K] [--decode-context-parallel-size N]
        [--out-dir DIR] [--budget SECONDS]

The driver writes a DeepSeek-V3-shaped model config into a temporary directory (model_config.py; on several GPUs the
real model with as many layers as fit, parallel.py), then starts one
engine process per backend (vllm_runner.py / sglang_runner.py: a fresh process, so a fresh CUDA context, for each),
ours first. Each process runs every workload (workloads.py) and leaves its results in a JSON file; the driver collects
them into serve_bench.json, serve_bench.md and serve_bench.png (report.py). A backend the engine refuses is reported
with the engine's reason. Backends that would not fit in ``--budget`` are skipped and listed, with the command that
runs them on their own; workloads that would not fit in the engine's KV cache are skipped and listed too.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..cli import nothing_ran
from ..host_trace import ENV_HOST_TIMERS
from ..verify import ENV_VERIFY
from . import agreement, hostile, resume, rounds, sglang_runner, verification, vllm_runner
from .model_config import (DEFAULT_MODEL, HEAD_CHOICES_DOC, MODEL_CHOICES, kv_bytes_per_token, parameter_counts,
                           shared_config_dir)
from .parallel import (MAX_SPECULATIVE_TOKENS, GpuInventory, ParallelOptions, check_parallel_options, detect_gpus,
                       resolve_model)
from .runner_common import (COMPILED, GPU_MEMORY_FRACTION, SGLANG_FP8_GPU_MEMORY_FRACTION, EngineChoice, EngineSpec,
                            default_gpu_memory_fraction, log_tail)
from .weight_memory import GIB, engine_budget_bytes, weight_bytes_per_gpu
from .workloads import (DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_WORKLOAD_KINDS, WORKLOAD_KINDS, MeasurePlan,
                        build_workloads, context_label, kv_tokens_needed, longest_request, most_requests,
                        workload_to_dict)

KILL_GRACE_S = 60.0  # an engine process past the budget gets this long to write its results before it is killed
GPU_RELEASE_S = 3.0  # pause between engines, so that the previous one's GPU memory is back
CUDA_OOM = "CUDA out of memory"  # torch.OutOfMemoryError's message
OOM_SCAN_CHARS = 200_000  # of a failed engine's log, from its end: an engine logs its shutdown after the error
DEFAULT_BUDGET_S = 3600
DEFAULT_ENGINE_TIMEOUT_S = 1800  # a hung engine must not take the whole budget


ENGINES = {engine.name: engine for engine in (vllm_runner.ENGINE, sglang_runner.ENGINE)}


def _int_list(text: str) -> tuple[int, ...]:
    """``"1,16,64"`` or ``"1k,8k,32k"`` (k = 1024)."""
    values = []
    for item in filter(None, (t.strip().lower() for t in text.split(","))):
        values.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return tuple(values)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mla-backend serve-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engine", required=True, choices=sorted(ENGINES))
    p.add_argument("--backends", help="comma list, ours first by default; vLLM: "
                   + ",".join(vllm_runner.ENGINE.backends) + "; SGLang: " + ",".join(sglang_runner.ENGINE.backends))
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOAD_KINDS),
                   help="comma list of " + ",".join(WORKLOAD_KINDS) + " (forced: teacher-forced agreement between the "
                   "backends, agreement.py)")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)), help="decode batch sizes")
    p.add_argument("--contexts", default=",".join(context_label(c) for c in DEFAULT_CONTEXTS),
                   help="decode context lengths (k = 1024 tokens)")
    p.add_argument("--model", choices=MODEL_CHOICES, default=DEFAULT_MODEL,
                   help="small-moe: DeepSeek-V3 attention with a small bf16 MoE, for one GPU; deepseek-v3: the "
                        "released model's shapes and fp8 block-quantised weights, for several GPUs")
    p.add_argument("--heads", type=int, help=f"small-moe's query heads (default 16): {HEAD_CHOICES_DOC}; "
                                             "deepseek-v3 has 128")
    p.add_argument("--layers", type=int, help="decoder layers (small-moe: default 8; deepseek-v3: default as many "
                                              "as fit the GPUs)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs the model is split over (vLLM tensor_parallel_size, SGLang tp_size)")
    p.add_argument("--dp-attention", action="store_true",
                   help="SGLang: data-parallel attention over the tensor-parallel GPUs (each keeps all heads)")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help=f"MTP draft tokens per step, 0..{MAX_SPECULATIVE_TOKENS} (vLLM deepseek_mtp, SGLang EAGLE)")
    p.add_argument("--decode-context-parallel-size", type=int, default=1,
                   help="vLLM decode_context_parallel_size (where its EngineArgs has it): a divisor of the TP size")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="memory of each GPU for the weight check (default: from nvidia-smi)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per workload (median and min-max reported)")
    p.add_argument("--rounds", type=int, default=1,
                   help="engine processes per backend, started in turn with the order reversed every other round; "
                        "each workload's repeats are pooled over them and each engine's median is reported (one "
                        "engine's host loop can run 1.5x slower than another's; later rounds are not profiled); with "
                        "--resume, only the rounds the earlier report lacks are run")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--init", choices=("dummy", "scaled"), default="dummy",
                   help="weights: the engine's dummy init, or N(0, 1/fan_in) so that attention moves the logits and "
                        "MoE routing spreads")
    p.add_argument("--verify", action="store_true",
                   help="every decode call of ours recomputed by the fp32 reference in each engine process "
                        "(MLA_BACKEND_VERIFY=1) and reported per rank; every engine runs eager, so speeds are eager "
                        "ones; exit status 1 when a rank is past the limits")
    p.add_argument("--gpu-memory-fraction", type=float,
                   help=f"vLLM gpu_memory_utilization / SGLang mem_fraction_static (default {GPU_MEMORY_FRACTION}; "
                        f"SGLang with an fp8 pool {SGLANG_FP8_GPU_MEMORY_FRACTION})")
    p.add_argument("--window-steps", type=int, default=MeasurePlan.window_steps, help="decode steps per timed window")
    p.add_argument("--profile-steps", type=int, default=MeasurePlan.profile_steps,
                   help="steps profiled per decode cell and mixed load for the attention share (0: none)")
    p.add_argument("--out-dir", default="serve_bench_results", help="serve_bench.{json,md,png}, logs and traces")
    p.add_argument("--resume", action="store_true",
                   help="keep the backends that the report already in --out-dir measured with the same settings and "
                        "start engines only for the others (one comparison over several invocations)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run: backends that would not fit are skipped and listed")
    p.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                   help="seconds one backend's engine process may take (start and every workload)")
    p.add_argument("--cold-start", choices=("restart", "measure"), default="restart",
                   help="an engine whose start or warm-up requests filled a compile cache (vLLM's torch.compile "
                        "graphs; SGLang's Triton, FlashInfer, TorchInductor, DeepGEMM, TileLang and tvm-ffi JIT "
                        "caches) ends and starts again warm before it is measured (restart); in our runs the engine "
                        "that compiled ran its host loop slower afterwards. measure: keep the first engine")
    p.add_argument("--dry-run", action="store_true", help="print the model, workloads and engine settings; run nothing")
    return p


@dataclass
class RunSetup:
    """Everything resolved from the command line."""

    engine: EngineChoice
    backends: tuple[str, ...]
    workloads: list
    plan: MeasurePlan
    model_config: dict
    kv_cache_dtype: str  # the engine's spelling
    args: argparse.Namespace
    parallel: ParallelOptions = ParallelOptions()
    gpus: GpuInventory = GpuInventory()

    @property
    def max_model_len(self) -> int:
        longest = max(longest_request(w, self.plan) for w in self.workloads)
        return min(-(-longest // 1024) * 1024, self.model_config["max_position_embeddings"])

    @property
    def max_num_seqs(self) -> int:
        return max(most_requests(w) for w in self.workloads)


def parallel_options(args: argparse.Namespace) -> ParallelOptions:
    return ParallelOptions(args.tensor_parallel_size, args.dp_attention, args.speculative_tokens,
                           args.decode_context_parallel_size)


def gpu_inventory(args: argparse.Namespace, detected: GpuInventory | None = None) -> GpuInventory:
    """The GPUs for the checks: ``--gpu-memory-gib`` wins over what nvidia-smi says."""
    detected = detect_gpus() if detected is None else detected
    if args.gpu_memory_gib is None:
        return detected
    if args.gpu_memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be positive, got {args.gpu_memory_gib}")
    return GpuInventory(detected.count, int(args.gpu_memory_gib * GIB))


def resolve(args: argparse.Namespace, detected_gpus: GpuInventory | None = None) -> RunSetup:
    """Checks the command line and builds the run; ValueError says what is wrong. ``detected_gpus``: the machine's
    GPUs (default: nvidia-smi's)."""
    engine = ENGINES[args.engine]
    backends = _str_list(args.backends) if args.backends else engine.backends
    backends = tuple(b.upper() if engine.name == "vllm" else b.lower() for b in backends)
    if not backends:
        raise ValueError("--backends is empty")
    if args.repeats < 1 or args.rounds < 1 or args.window_steps < 2 or args.profile_steps < 0:
        raise ValueError("--repeats and --rounds must be >= 1, --window-steps >= 2, --profile-steps >= 0")
    if args.budget <= 0 or args.engine_timeout <= 0:
        raise ValueError("--budget and --engine-timeout must be positive")
    workloads = build_workloads(_str_list(args.workloads), _int_list(args.batches), _int_list(args.contexts))
    if not workloads:
        raise ValueError("no workload selected")
    plan = MeasurePlan(repeats=args.repeats, window_steps=args.window_steps, profile_steps=args.profile_steps)
    if args.gpu_memory_fraction is None:
        args.gpu_memory_fraction = default_gpu_memory_fraction(engine.name, args.kv_cache_dtype)
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    gpus = gpu_inventory(args, detected_gpus)
    options = parallel_options(args)
    check_parallel_options(engine.name, options, gpus)
    model_config = resolve_model(args.model, args.heads, args.layers, options, gpus, args.gpu_memory_fraction)
    return RunSetup(engine, backends, workloads, plan, model_config, engine.kv_cache_dtypes[args.kv_cache_dtype], args,
                    options, gpus)


def describe_run(run: RunSetup) -> list[str]:
    """The dry-run listing: model, engine settings and every workload with the KV cache it needs."""
    config, counts = run.model_config, parameter_counts(run.model_config)
    per_token = kv_bytes_per_token(config, run.kv_cache_dtype)
    options = run.parallel
    weights = weight_bytes_per_gpu(config, options.layout)
    memory = run.gpus.memory_bytes
    budget = (f"of {engine_budget_bytes(memory, run.args.gpu_memory_fraction) / GIB:.1f} GiB the engine may use"
              if memory else "(GPU memory unknown: not checked)")
    lines = [f"engine {run.engine.name}; backends {', '.join(run.backends)}; page size {run.engine.page_size}; "
             f"KV cache {run.kv_cache_dtype}; weights {run.args.init}"
             + ("; every engine eager, each decode call of ours checked by the fp32 reference (--verify)"
                if run.args.verify else ""),
             f"model {run.args.model}: DeepSeek-V3 attention with {config['num_attention_heads']} heads, "
             f"{config['num_hidden_layers']} layers, MoE {config['n_routed_experts']} x "
             f"{config['moe_intermediate_size']} top-{config['num_experts_per_tok']}, "
             f"{weight_format(config)} weights; {sum(counts.values()) / 1e9:.2f} B parameters "
             f"({', '.join(f'{k} {v / 1e9:.2f} B' for k, v in counts.items())}); KV {per_token} bytes per token",
             f"GPUs {options.tensor_parallel_size}: TP {options.tensor_parallel_size}, attention DP "
             f"{options.attention_data_parallel_size}, {options.heads_per_gpu(config['num_attention_heads'])} heads "
             f"per GPU, MTP {options.speculative_tokens} draft tokens, decode context parallel "
             f"{options.decode_context_parallel_size}; weights {sum(weights.values()) / GIB:.1f} GiB per GPU "
             f"{budget}",
             f"max_model_len {run.max_model_len}, max_num_seqs {run.max_num_seqs}; {run.plan.repeats} repeats, "
             f"{run.plan.window_steps} decode steps per window, {run.plan.profile_steps} profiled steps"
             + (f"; {run.args.rounds} engine processes per backend (rounds)" if run.args.rounds > 1 else ""),
             f"{'workload':<32}{'KV tokens':>12}{'KV GiB':>9}"]
    for w in run.workloads:
        tokens = kv_tokens_needed(w, run.plan)
        lines.append(f"{w.name:<32}{tokens:>12}{tokens * per_token / 2**30:>9.1f}")
    return lines


def weight_format(config: dict) -> str:
    """``fp8 blocks 128x128`` or ``bf16``."""
    quant = config.get("quantization_config")
    if not quant:
        return "bf16"
    return f"{quant['quant_method']} blocks {'x'.join(map(str, quant['weight_block_size']))}"


# ----------------------------------------------------------------------------- engine processes
def package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


#: vLLM 0.26 fuses the tensor-parallel all-reduce with RMSNorm through FlashInfer and picks FlashInfer's ``mnnvl``
#: backend, which maps NVLink multicast memory. On a host that turned multicast off for NCCL (``NCCL_NVLS_ENABLE=0``)
#: the workers then hit an illegal memory access while vLLM profiles its CUDA graphs, with every attention backend;
#: ``trtllm`` is FlashInfer's backend without multicast. Only set where the user chose none.
FLASHINFER_ALLREDUCE_WITHOUT_MULTICAST = ("VLLM_FLASHINFER_ALLREDUCE_BACKEND", "trtllm")
#: Where DeepGEMM is installed, SGLang's start compiles its fp8 GEMMs for every batch size up to the largest before
#: the first request (10-20 minutes with an empty cache, by SGLang's own message; an EAGLE engine of the released
#: model had not started after 9.5). Off, each compiles on first use, in the warm-up requests, which the cold-start
#: check counts (DeepGEMM's cache is one it watches), so the engine measured is warm all the same. Every backend
#: alike; only set where the user chose none.
DEEPGEMM_PRECOMPILE_OFF = ("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")


def child_env(verify: bool = False) -> dict:
    """The engine process's environment: this package importable (a source checkout has no entry point), no NVLink
    multicast in FlashInfer's all-reduce where NCCL has it off, no DeepGEMM precompile at SGLang's start, our host
    timers on (unless the user set them), and with ``verify`` the fp32 check of our calls."""
    env = dict(os.environ)
    if verify:
        env[ENV_VERIFY] = "1"
    env.setdefault(ENV_HOST_TIMERS, "1")  # our ranges' host time without a profiler (about 0.2 µs more a call)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root(), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault(*DEEPGEMM_PRECOMPILE_OFF)
    if env.get("NCCL_NVLS_ENABLE") == "0":
        env.setdefault(*FLASHINFER_ALLREDUCE_WITHOUT_MULTICAST)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def stop_process_group(proc: subprocess.Popen) -> None:
    """Ends the engine process and everything it started (engine core, scheduler, workers): the group it leads, and
    any process below it that left the group (an engine's workers hold the GPU memory the next engine needs)."""
    below = descendants(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        for pid in below:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)


def _interrupt(signum, frame):  # noqa: ARG001 - signal handler's signature
    raise KeyboardInterrupt(f"signal {signum}")


def out_of_memory_hint(spec: EngineSpec) -> str:
    """What to change when an engine's log shows a CUDA out-of-memory error."""
    hint = (f"its log shows CUDA out of memory: a --gpu-memory-fraction below {spec.gpu_memory_fraction} leaves the "
            "engine more GPU memory beside its KV cache")
    if spec.engine == "sglang" and spec.kv_cache_dtype.startswith("fp8"):
        # sglang 0.5.17 flashinfer_mla_backend.forward_extend: get_key_buffer(layer).to(q.dtype), whatever the
        # decode backend (flashmla's and ours delegate prefill to it)
        hint += (" (with an fp8 pool SGLang's FlashInfer MLA prefill, which flashmla's and ours run prefill on, "
                 "converts a layer's whole pool to bf16: 1152 bytes per pool token)")
    return hint


def run_engine(spec: EngineSpec, runner: str, spec_path: Path, timeout_s: float) -> dict:
    """One engine process; returns its result file, or why there is none."""
    spec.save(spec_path)
    t0 = time.perf_counter()
    timed_out = False
    with open(spec.log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", runner, str(spec_path)], stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(spec.verify), start_new_session=True)
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            stop_process_group(proc)
            time.sleep(GPU_RELEASE_S)
    try:
        result = json.loads(Path(spec.result_path).read_text())
    except (OSError, ValueError):
        result = {"engine": spec.engine, "backend": spec.backend, "status": "starting", "workloads": []}
    if result.get("status") in ("starting", "running"):  # the process ended before it could say how it went
        how = "was killed at the time budget" if timed_out else f"exited with status {proc.returncode}"
        result.update(status="failed", reason=f"the engine process {how} before it finished")
    if result["status"] == "failed":
        log = log_tail(spec.log_path, OOM_SCAN_CHARS)
        result["log_tail"] = log[-4000:]
        if CUDA_OOM in log:
            result["reason"] += "; " + out_of_memory_hint(spec)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["exit_code"] = proc.returncode
    return result


def engine_spec(run: RunSetup, backend: str, model_dir: Path, work: Path, out_dir: Path, in_process: bool,
                hard_deadline: float) -> EngineSpec:
    safe = backend.replace("/", "_")
    profile_dir = out_dir / f"{run.engine.name}-traces" / safe
    profile_dir.mkdir(parents=True, exist_ok=True)
    return EngineSpec(engine=run.engine.name, backend=backend, model_dir=str(model_dir),
                      vocab_size=run.model_config["vocab_size"], result_path=str(work / f"{safe}.result.json"),
                      log_path=str(out_dir / f"{run.engine.name}-logs" / f"{safe}.log"), profile_dir=str(profile_dir),
                      workloads=[workload_to_dict(w) for w in run.workloads], plan=dataclasses.asdict(run.plan),
                      kv_cache_dtype=run.kv_cache_dtype, page_size=run.engine.page_size, init=run.args.init,
                      gpu_memory_fraction=run.args.gpu_memory_fraction, max_model_len=run.max_model_len,
                      max_num_seqs=run.max_num_seqs, in_process=in_process, deadline=hard_deadline,
                      hard_deadline=hard_deadline, tensor_parallel_size=run.parallel.tensor_parallel_size,
                      dp_attention=run.parallel.dp_attention, speculative_tokens=run.parallel.speculative_tokens,
                      decode_context_parallel_size=run.parallel.decode_context_parallel_size, verify=run.args.verify,
                      restart_cold=run.args.cold_start == "restart")


def alone_command(argv: list[str], backend: str) -> str:
    """The command that runs one skipped backend on its own and adds it to this run's report (``--resume``)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--backends":
            skip = True
            continue
        if not arg.startswith("--backends="):
            kept.append(arg)
    return "mla-backend serve-bench " + " ".join(kept + ["--backends", backend] + ([] if "--resume" in kept
                                                                                  else ["--resume"]))


def measure_engine(run: RunSetup, spec: EngineSpec, work: Path) -> dict:
    """One backend's engine process, started again warm when its start or warm-up filled a compile cache."""
    backend = spec.backend
    result = run_engine(spec, run.engine.runner, work / f"{backend}.spec.json",
                        spec.hard_deadline + KILL_GRACE_S - time.time())
    if result.get("status") == COMPILED:  # the caches are warm now: measure a second start
        cold_info = result.get("engine_info") or {}
        cold_start_s = cold_info.get("start_s")
        print(f"[serve-bench] {backend}: its start or warm-up filled a compile cache ({cold_start_s} s "
              "start); starting it again warm", flush=True)
        spec.restart_cold = False
        Path(spec.log_path).replace(Path(spec.log_path).with_suffix(".cold.log"))
        result = run_engine(spec, run.engine.runner, work / f"{backend}.spec.json",
                            spec.hard_deadline + KILL_GRACE_S - time.time())
        result.setdefault("engine_info", {})["cold_start_s"] = cold_start_s
        if cold_info.get("grown_caches"):
            result["engine_info"]["cold_start_caches"] = cold_info["grown_caches"]
    return result


def later_round_spec(spec: EngineSpec, round_index: int) -> EngineSpec:
    """Round ``round_index``'s (>= 1) engine: its own log and result files, and no profile (the first round's
    traces stand for the backend)."""
    suffix = f".round{round_index + 1}"
    log, result = Path(spec.log_path), Path(spec.result_path)
    plan = dict(spec.plan, profile_steps=0)
    return dataclasses.replace(spec, log_path=str(log.with_suffix(suffix + log.suffix)),
                               result_path=str(result.with_name(result.stem + suffix + ".json")), plan=plan)


def run_backends(run: RunSetup, model_dir: Path, work: Path, out_dir: Path, argv: list[str],
                 kept: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every backend in its own engine process, in order, within the budget, ``--rounds`` times (rounds.py); those in
    ``kept`` (``--resume``) are taken as they are, and kept backends not asked for stay in the report after the
    others."""
    kept = kept or {}
    (out_dir / f"{run.engine.name}-logs").mkdir(parents=True, exist_ok=True)
    in_process = run.engine.name == "vllm" and vllm_runner.needs_in_process()
    start = time.time()
    hard_deadline = start + run.args.budget
    results: dict[str, dict] = {}
    walls: list[float] = [r["wall_s"] for r in kept.values() if "wall_s" in r]
    started, backend = 0, None
    try:
        for round_index in range(run.args.rounds):
            order = rounds.round_order(run.backends, round_index)
            if round_index:
                # A later round starts only when all of its engines fit: one more engine for some backends than for
                # others would weigh the pooled medians towards them (an --resume run adds the whole round later).
                pending = [b for b in order if b not in kept or round_index >= rounds.engines_run(kept[b])]
                pending = [b for b in pending if results[b].get("status") == "done"]
                elapsed, estimate = time.time() - start, max(walls, default=run.engine.first_engine_estimate_s)
                if pending and elapsed + len(pending) * estimate > run.args.budget:
                    why = (f"time budget: {elapsed:.0f} of {run.args.budget:.0f} s used and its {len(pending)} "
                           f"engines take about {len(pending) * estimate:.0f} s")
                    for skipped_backend in pending:
                        results[skipped_backend].setdefault("rounds_skipped", []).append(
                            f"round {round_index + 1}: {why}")
                    print(f"[serve-bench] round {round_index + 1} skipped ({why})", flush=True)
                    continue
            for backend in order:
                if backend in kept and round_index < rounds.engines_run(kept[backend]):
                    if round_index == 0:
                        results[backend] = rounds.resumed(kept[backend], run.args.rounds)
                        print(f"[serve-bench] {backend}: {rounds.engines_run(kept[backend])} engine(s) kept from the "
                              f"run of {kept[backend]['from_run'].get('date')}", flush=True)
                    continue
                if round_index and results[backend].get("status") != "done":
                    continue  # refused, failed or skipped in an earlier round: not started again
                elapsed = time.time() - start
                estimate = max(walls) if walls else run.engine.first_engine_estimate_s
                if started and elapsed + estimate > run.args.budget:  # the first engine always starts
                    why = (f"time budget: {elapsed:.0f} of {run.args.budget:.0f} s used and an engine takes about "
                           f"{estimate:.0f} s")
                    if round_index:
                        results[backend].setdefault("rounds_skipped", []).append(f"round {round_index + 1}: {why}")
                    else:
                        results[backend] = {"backend": backend, "status": "skipped", "workloads": [],
                                            "reason": f"{why}; add it to this report later: "
                                                      f"{alone_command(argv, backend)}"}
                    print(f"[serve-bench] {backend}: round {round_index + 1} skipped ({why})", flush=True)
                    continue
                engine_deadline = min(hard_deadline, time.time() + run.args.engine_timeout)
                spec = engine_spec(run, backend, model_dir, work, out_dir, in_process, engine_deadline)
                if round_index:
                    spec = later_round_spec(spec, round_index)
                print(f"[serve-bench] {backend}: engine starting, round {round_index + 1} of {run.args.rounds} "
                      f"(log: {spec.log_path})", flush=True)
                started += 1
                result = measure_engine(run, spec, work)
                walls.append(result["wall_s"])
                results[backend] = rounds.pool(results[backend], result) if round_index else result
                done = sum(1 for w in result.get("workloads", []) if w.get("status") == "ok")
                print(f"[serve-bench] {backend}: {result['status']} in {result['wall_s']:.0f} s, {done} workload(s) "
                      "measured" + (f"; {result['reason']}" if result.get("reason") else ""), flush=True)
    except KeyboardInterrupt as stop:  # SIGTERM or Ctrl-C: run_engine ended the engine; keep what was measured
        stopped = f"serve-bench was stopped ({stop or 'interrupt'})"
        if backend is not None and backend not in results:
            results[backend] = {"backend": backend, "status": "failed", "workloads": [],
                                "reason": f"{stopped} while this engine ran"}
        for measured in results.values():  # later rounds not run: the earlier rounds' engines stay measured
            if measured.get("status") == "done":
                ran = rounds.engines_run(measured)
                measured.setdefault("rounds_skipped", []).extend(
                    f"round {r + 1}: {stopped}" for r in range(ran, run.args.rounds))
        results.update((b, {"backend": b, "status": "skipped", "workloads": [], "reason": f"{stopped}; "
                            f"add it to this report later: {alone_command(argv, b)}"})
                       for b in run.backends if b not in results and b not in kept)
        print(f"[serve-bench] {stopped}: writing the report of what was measured", flush=True)
    results.update((backend, result) for backend, result in kept.items() if backend not in results)
    return results


def run_blocker(engine: str) -> str | None:
    """Why nothing can be measured here (no CUDA GPU, or the engine is not installed), or None."""
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    return engine_problem(engine)


def engine_problem(engine: str) -> str | None:
    """Why the engine cannot run here, or None."""
    if importlib.util.find_spec(engine) is None:
        extra = "vllm" if engine == "vllm" else "sglang"
        return f"{engine} is not installed (pip install -e \".[{extra}]\")"
    return None


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when at least one workload was measured (or --dry-run), 1 when the forced check's agreement or
    the fp32 verification (``--verify``) failed, 2 when nothing was measured."""
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a `timeout` or a scheduler's stop still ends the running engine
    if hostile.selected(argv):  # its own flags and its own report (hostile.py)
        return hostile.main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run = resolve(args)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        print("\n".join(describe_run(run)))
        return 0
    blocker = run_blocker(args.engine)
    if blocker:
        return nothing_ran("serve-bench", f"{blocker}; nothing to measure (--dry-run lists the model and the "
                                          "workloads).")
    from . import report

    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = report.environment(argv, args.engine)
    print(f"[serve-bench] {env.get('gpu')}: {args.engine} {env.get(args.engine)}, backends {', '.join(run.backends)}; "
          f"{len(run.workloads)} workloads; budget {args.budget:.0f} s", flush=True)
    try:
        kept = resume.kept_backends(out_dir, report.run_settings(run), run.model_config, env) if args.resume else {}
    except ValueError as e:
        parser.error(str(e))
    t0 = time.perf_counter()
    model_dir = shared_config_dir(run.model_config, fallback=out_dir / "model")
    with tempfile.TemporaryDirectory(prefix="serve_bench_") as tmp:
        results = run_backends(run, model_dir, Path(tmp), out_dir, argv, kept)
    data = report.assemble(env, run, results, time.perf_counter() - t0)
    files = report.write_outputs(out_dir, data)
    print("\n" + report.markdown(data))
    print(f"[serve-bench] wrote {', '.join(files)}")
    if not report.anything_measured(data):
        return nothing_ran("serve-bench", "no workload was measured on any backend (see the reasons above).")
    failed = [w for w, verdict in agreement.compare(data).items() if verdict["passed"] is False]
    if failed:
        print(f"[serve-bench] teacher-forced agreement FAILED: {', '.join(failed)}", flush=True)
    checked = verification.verdict(data)
    verify_failed = checked is not None and not checked["passed"]
    if verify_failed:
        print(f"[serve-bench] fp32 verification FAILED: {checked['reason']}", flush=True)
    return 1 if failed or verify_failed else 0
