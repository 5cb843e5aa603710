"""What both engine processes share: the spec they are started with, the loop over workloads, and the result file.

An engine process (``python -m mla_backend.serve_bench.vllm_runner SPEC`` or ``...sglang_runner SPEC``) starts one
engine with one attention backend, runs every workload on it and rewrites its result file after each one, so that a
run cut short by the time budget still leaves what it measured. An engine that does not start is reported as
refused, with the reason taken from the exception or, where the engine only says "see above", from its log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .measure import RequestSeries, TokenTracker, decode_window_tpots, median_or_none, summarize, tpot_between
from .parallel import ParallelOptions
from .profile_trace import (host_ranges, host_step_ops, kernel_breakdown, load_trace_events, range_children,
                            traces_since)
from .workloads import (FORCED, MIN_PREFILL_CHUNK, DecodeCell, ForcedDecode, MeasurePlan, MixedLoad, ThroughputLoad,
                        Workload, decode_max_tokens, kv_tokens_needed, mixed_decoder_max_tokens, prompt_seed,
                        token_prompts, workload_from_dict, workload_to_dict)

# A workload does not start with less than this left before the deadline (a decode cell takes 5-60 s).
MIN_WORKLOAD_S = 30.0
#: The warm-up before any timing: short prompts, each decoding a few tokens (EngineSession.warmup_prompts).
WARMUP_PROMPTS, WARMUP_LEN, WARMUP_TOKENS = 4, 512, 8

#: Status of an engine process that ended after a start that filled a compile cache (``EngineSpec.restart_cold``): the
#: driver starts it again, now with warm compile caches, and measures that one.
COMPILED = "compiled"
TRACE_READ_ATTEMPTS = 10

#: vLLM's gpu_memory_utilization / SGLang's mem_fraction_static where --gpu-memory-fraction is not given.
GPU_MEMORY_FRACTION = 0.85
#: SGLang with an fp8 pool: its FlashInfer MLA prefill (flashmla's and ours) converts a layer's whole pool to bf16
#: beside the pool (1152 bytes per pool token), so the pool leaves room for that copy. On one H200, serve-bench's
#: 8-layer model ran out of memory in its first prefill at 0.85, with 16 heads and with 128, and ran at 0.6
#: (benchmarks/RESULTS.md section 9).
SGLANG_FP8_GPU_MEMORY_FRACTION = 0.6


def default_gpu_memory_fraction(engine: str, kv_cache_dtype: str) -> float:
    """The engine's memory fraction for ``--kv-cache-dtype`` (auto / fp8) where the command line names none."""
    if engine == "sglang" and kv_cache_dtype == "fp8":
        return SGLANG_FP8_GPU_MEMORY_FRACTION
    return GPU_MEMORY_FRACTION


def cache_counts(roots) -> dict[str, int]:
    """Files under each of the directories ``roots`` (absent ones count 0): a compile cache that holds more after an
    engine's start than before it was filled by that start."""
    return {str(root): sum(len(files) for _, _, files in os.walk(root)) for root in roots}


def grown_caches(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The caches of ``after`` that hold more files than in ``before``."""
    return [root for root, count in after.items() if count > before.get(root, 0)]


@dataclass
class EngineSpec:
    """One engine process: the engine, the attention backend and everything it is started with."""

    engine: str  # "vllm" or "sglang"
    backend: str  # the engine's name for the attention backend
    model_dir: str
    vocab_size: int
    result_path: str
    log_path: str
    profile_dir: str
    workloads: list[dict] = field(default_factory=list)
    plan: dict = field(default_factory=dict)
    kv_cache_dtype: str = "auto"  # the engine's spelling
    page_size: int = 64
    init: str = "dummy"  # "dummy" (the engine's own) or "scaled" (random_weights.py)
    gpu_memory_fraction: float = GPU_MEMORY_FRACTION
    max_model_len: int = 34816
    max_num_seqs: int = 256
    in_process: bool = False  # vLLM: engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    deadline: float = float("inf")  # epoch seconds: no workload starts within MIN_WORKLOAD_S of it
    hard_deadline: float = float("inf")  # epoch seconds: a running workload stops here
    tensor_parallel_size: int = 1  # GPUs the model is split over
    dp_attention: bool = False  # SGLang: attention data-parallel over the TP GPUs
    speculative_tokens: int = 0  # MTP draft tokens per step (0: no speculative decoding)
    decode_context_parallel_size: int = 1  # vLLM: GPUs each request's KV cache is spread over in decode
    verify: bool = False  # eager engine, every decode call of ours recomputed by the fp32 reference (verify.py)
    restart_cold: bool = False  # end the engine after a start that filled a compile cache, for a warm second start

    @property
    def forces_tokens(self) -> bool:
        """Whether a workload is the forced check (the engine then needs its forcing processor)."""
        return any(w["kind"] == FORCED for w in self.workloads)

    @property
    def parallel(self) -> ParallelOptions:
        return ParallelOptions(self.tensor_parallel_size, self.dp_attention, self.speculative_tokens,
                               self.decode_context_parallel_size)

    @property
    def measure_plan(self) -> MeasurePlan:
        return MeasurePlan(**self.plan)

    def workload_list(self) -> list[Workload]:
        return [workload_from_dict(w) for w in self.workloads]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> EngineSpec:
        return cls(**json.loads(Path(path).read_text()))


class OutOfTime(RuntimeError):
    """The hard deadline passed inside a workload."""


def check_deadline(spec: EngineSpec) -> None:
    if time.time() > spec.hard_deadline:
        raise OutOfTime("the time budget ran out inside this workload")


def write_result(path: str | Path, result: dict) -> None:
    """Atomically replaces the result file (the driver may read it at any time after a kill)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- why an engine did not start
_GENERIC_FAILURES = ("initialization failed", "see root cause above", "see stack trace above", "scheduler is dead",
                     "child process unexpectedly", "process died", "exited unexpectedly")
_ERROR_LINE = re.compile(r"^(?:.*?\s)?([A-Za-z_][\w.]*(?:Error|Exception|Exit)): (.+)$")
_SELECTION_REASON = re.compile(r"(Selected backend \S+ is not valid for this configuration\.? Reason: .*)$")


def refusal_reason(error: BaseException | str, log_text: str = "") -> str:
    """The most specific one-line reason an engine gave for not starting.

    vLLM's backend selection names its reasons ("Selected backend X is not valid for this configuration. Reason:
    [...]"); where the exception raised here is only the engine's generic "initialization failed, see above", the last
    ``SomethingError: message`` line of the log (the engine core's or scheduler's own traceback) is the reason."""
    message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    for text in (message, log_text):
        for line in reversed(text.splitlines()):
            found = _SELECTION_REASON.search(line)
            if found:
                return found.group(1).strip()
    if any(marker in message.lower() for marker in _GENERIC_FAILURES) or not message.strip():
        for line in reversed(log_text.splitlines()):
            found = _ERROR_LINE.match(line.strip())
            if found and not any(m in found.group(2).lower() for m in _GENERIC_FAILURES):
                return f"{found.group(1)}: {found.group(2)}".strip()
    return message.strip().splitlines()[0] if message.strip() else "unknown"


def log_tail(path: str | Path, chars: int = 20000) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return text[-chars:]


# ----------------------------------------------------------------------------- results
def measurement(workload: Workload, repeats: list[dict], **extra) -> dict:
    """A workload's record: its raw repeats and, for every number they carry, the median and the min-max spread."""
    keys = sorted({k for r in repeats for k, v in r.items() if isinstance(v, (int, float))})
    record = {"workload": workload.name, "kind": workload.kind, "params": workload_to_dict(workload),
              "status": "ok" if repeats else "no data", "repeats": repeats}
    record.update({key: summarize(r.get(key) for r in repeats) for key in keys})
    record.update(extra)
    return record


def skipped(workload: Workload, reason: str) -> dict:
    return {"workload": workload.name, "kind": workload.kind, "params": workload_to_dict(workload),
            "status": "skipped", "reason": reason}


def kv_capacity_problem(workload: Workload, plan: MeasurePlan, capacity_tokens: int | None,
                        chunk_tokens: int) -> str | None:
    """Why the workload cannot run in the engine's KV cache, or None when it fits (with 10% to spare)."""
    if not capacity_tokens:
        return None
    needed = kv_tokens_needed(workload, plan, chunk_tokens)
    if needed > 0.9 * capacity_tokens:
        return (f"needs {needed} KV-cache tokens, the engine holds {capacity_tokens} (more GPU memory, fp8 KV or "
                f"fewer layers would fit it)")
    return None


def _read_trace(path: Path, steps: int) -> tuple[list[dict], dict] | None:
    """One trace's events and kernel-time breakdown, or None while it is still being written."""
    for attempt in range(TRACE_READ_ATTEMPTS):
        try:
            events = load_trace_events(path)
            return events, kernel_breakdown(events, steps)
        except (OSError, ValueError, EOFError):
            time.sleep(0.5 * (attempt + 1))
    return None


def read_profile(directory: str | Path, since: float, steps: int, pattern: str = "*.json*") -> dict:
    """The kernel-time breakdown and host ranges of the traces written in ``directory`` since ``since``: where the
    engine runs on several GPUs (one trace each), the GPU with the most attention time, the one that holds the
    requests when DP attention leaves others idle, so every backend is read on a GPU doing the same work."""
    paths = traces_since(directory, since, pattern)
    if not paths:
        return {"error": f"no profiler trace was written in {directory}"}
    kept, kept_events, breakdown, read = None, None, None, 0
    for path in paths:
        found = _read_trace(path, steps)
        if found is None:
            continue
        read += 1
        if breakdown is None or found[1]["attention_us_per_step"] > breakdown["attention_us_per_step"]:
            kept, (kept_events, breakdown) = path, found
    if breakdown is None:
        return {"error": f"could not read the profiler trace {paths[-1]}"}
    # the host ranges of the kept trace only
    breakdown.update(host=host_ranges(kept_events), host_children=range_children(kept_events),
                     host_step=host_step_ops(kept_events, steps), trace=kept.name, traces_read=read)
    return breakdown


def new_result(spec: EngineSpec) -> dict:
    return {"engine": spec.engine, "backend": spec.backend, "status": "starting", "page_size": spec.page_size,
            "kv_cache_dtype": spec.kv_cache_dtype, "init": spec.init, "workloads": []}


def run_workloads(spec: EngineSpec, session, result: dict) -> None:
    """Runs every workload of ``spec`` on the started ``session``; each result is written as soon as it exists."""
    plan = spec.measure_plan
    for workload in spec.workload_list():
        if time.time() > spec.deadline - MIN_WORKLOAD_S:
            result["workloads"].append(skipped(workload, "time budget"))
            continue
        problem = kv_capacity_problem(workload, plan, session.kv_capacity_tokens, session.prefill_chunk_tokens)
        if problem:
            result["workloads"].append(skipped(workload, problem))
            write_result(spec.result_path, result)
            continue
        print(f"[serve-bench] {spec.backend}: {workload.name}", flush=True)
        t0 = time.perf_counter()
        try:
            session.host_timings()  # starts this workload's interval
            record = session.run(workload, plan)
            timings = session.host_timings()
            if timings:
                record["host_timers"] = timings
        except Exception as e:  # noqa: BLE001 - one failed workload must not lose the others
            record = {"workload": workload.name, "kind": workload.kind, "params": workload_to_dict(workload),
                      "status": "error", "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}
        record["wall_s"] = round(time.perf_counter() - t0, 1)
        result["workloads"].append(record)
        write_result(spec.result_path, result)


def run_engine_process(spec: EngineSpec, session) -> dict:
    """Starts the engine, runs the workloads, shuts the engine down; returns (and writes) the result."""
    result = new_result(spec)
    write_result(spec.result_path, result)
    t0 = time.perf_counter()
    try:
        result["engine_info"] = session.start()
    except Exception as e:  # noqa: BLE001 - a refusal is a result
        result.update(status="refused", reason=refusal_reason(e, log_tail(spec.log_path)),
                      error=f"{type(e).__name__}: {e}"[:2000], start_s=round(time.perf_counter() - t0, 1))
        write_result(spec.result_path, result)
        return result
    result.update(status="running", start_s=round(time.perf_counter() - t0, 1))
    write_result(spec.result_path, result)
    try:
        session.warmup()
        # Kernels that compile lazily (SGLang's fp8 KV-cache writes, say) fill their cache in the warmup's first
        # forward, so the engine counts as cold if its start or its warmup compiled.
        grown = session.compiled_since_start()
        if grown:
            result["engine_info"].update(compiled_at_start=True, grown_caches=grown)
        if spec.restart_cold and result["engine_info"].get("compiled_at_start"):
            # An engine that compiled in its own process ran its host loop slower afterwards (docs: serve-bench):
            # measure a second start instead, which finds the caches this one filled.
            result["status"] = COMPILED
        else:
            run_workloads(spec, session, result)
            if spec.verify:
                result["verification"] = session.verification()
            result["status"] = "done"
    except Exception as e:  # noqa: BLE001
        result.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    finally:
        stop_session(session, result)
    write_result(spec.result_path, result)
    return result


def stop_session(session, result: dict) -> None:
    """Shut the engine down; a failure to do so is recorded, not raised (the results are in already)."""
    try:
        session.shutdown()
    except Exception as e:  # noqa: BLE001
        result["shutdown_error"] = f"{type(e).__name__}: {e}"


def engine_process_main(session_class, argv: list[str] | None = None) -> int:
    """``python -m mla_backend.serve_bench.<engine>_runner SPEC_JSON``: one engine process; exit 0 when its workloads
    ran or the engine refused the backend (a refusal is a result), 1 when it failed."""
    spec = EngineSpec.load((sys.argv[1:] if argv is None else argv)[0])
    result = run_engine_process(spec, session_class(spec))
    return 0 if result["status"] in ("done", "refused") else 1


# ----------------------------------------------------------------------------- records both engines build
def forced_record(load: ForcedDecode, argmax: list[list[int]], forcing_held: bool) -> dict:
    """The forced check's record: per request, the model's own argmax at each step; whether every request emitted
    its script (else the forcing did not hold and the argmax lists are not comparable)."""
    status = "ok" if forcing_held and argmax else "error"
    record = {"workload": load.name, "kind": load.kind, "params": workload_to_dict(load), "status": status,
              "argmax": argmax, "forcing_held": forcing_held}
    if not forcing_held:
        record["error"] = "a request did not emit its scripted tokens: the forcing did not hold"
    return record


def decode_record(cell: DecodeCell, plan: MeasurePlan, series: dict[str, RequestSeries], base: dict[str, int],
                  profile: dict | None, prefill_s: float) -> dict:
    """A decode cell's record: one repeat per timed window (TPOT of the full batch and the batch's output rate)."""
    tpots = decode_window_tpots(series, base, plan.warmup_steps, plan.window_steps, plan.repeats)
    repeats = [{"tpot_ms": t * 1e3, "output_tok_per_s": cell.batch / t} for t in tpots if t > 0]
    return measurement(cell, repeats, profile=profile, prefill_s=round(prefill_s, 2),
                       steps_per_repeat=plan.window_steps)


def mixed_repeat(tracker: TokenTracker, decoders: list[str], long_prompts: list[str], window_start: float,
                 decoder_count: int | None = None) -> dict:
    """One run of the mixed load, from the first long prompt's arrival to the last one's first token: the decoders'
    median TPOT, the long prompts' median TTFT, and every output token in the window per second. ``decoders`` may be
    a sample of the ``decoder_count`` decoders (they all decode in the same steps); their tokens are scaled up."""
    longs = tracker.subset(long_prompts)
    window_end = max(s.first_time for s in longs.values())
    tpot, sampled_tokens = tpot_between(tracker.subset(decoders), window_start, window_end)
    decoder_tokens = sampled_tokens * (decoder_count or len(decoders)) / max(len(decoders), 1)
    long_tokens = sum(s.tokens_at(window_end) for s in longs.values())
    seconds = window_end - window_start
    ttft = median_or_none(s.ttft() for s in longs.values())
    return {"tpot_ms": tpot * 1e3 if tpot else None, "ttft_ms": ttft * 1e3 if ttft is not None else None,
            "output_tok_per_s": (decoder_tokens + long_tokens) / seconds if seconds > 0 else None,
            "window_s": seconds}


@dataclass(frozen=True)
class EngineChoice:
    """What the driver and the hostile load need to know about an engine (its runner module holds the rest)."""

    name: str
    runner: str  # module run as the engine process
    backends: tuple[str, ...]  # ours first
    kv_cache_dtypes: dict[str, str]  # the engine's spelling of the CLI's --kv-cache-dtype values
    page_size: int  # every backend's
    first_engine_estimate_s: float = 420.0  # an engine's start plus the default workloads, before one has run

    @property
    def ours(self) -> str:
        return self.backends[0]


class EngineSession:
    """The interface :func:`run_engine_process` drives; each engine runner subclasses it."""

    spec: EngineSpec
    cached_before: dict[str, int] = {}  # files in each compile cache when the start began (read-only default)
    kv_capacity_tokens: int | None = None
    prefill_chunk_tokens: int = MIN_PREFILL_CHUNK
    reserved_tokens: int = 0  # slots per request the engine counts against the context beyond input and output

    def start(self) -> dict:
        raise NotImplementedError

    def warmup(self) -> None:
        """Runs a few short requests so that lazily compiled kernels are built before anything is timed."""

    def warmup_prompts(self) -> list[list[int]]:
        """The warm-up's prompts: a few short ones, and one a little longer than a prefill chunk, whose second chunk
        attends to its first as a cached prefix: a path an engine may build lazily on its first long prompt (with
        short prompts only, an SGLang engine with an fp8 cache stalled 19 s, its main thread mostly idle, in the
        first repeat of a mixed load)."""
        long_len = min(self.prefill_chunk_tokens + WARMUP_LEN,
                       self.spec.max_model_len - WARMUP_TOKENS - 1 - self.reserved_tokens)
        return (token_prompts(WARMUP_PROMPTS, WARMUP_LEN, self.spec.vocab_size, seed=12345)
                + token_prompts(1, long_len, self.spec.vocab_size, seed=12346))

    def compile_cache_counts(self) -> dict[str, int]:
        """Files in each of this engine's compile caches (cache_counts); none by default."""
        return {}

    def compiled_since_start(self) -> list[str]:
        """The engine's compile caches that grew since its start began (the start's own growth included): ``start``
        records ``cached_before`` first."""
        return grown_caches(self.cached_before, self.compile_cache_counts())

    def traces_written(self, directory: str | Path, since: float, pattern: str) -> bool:
        """Every GPU's profiler trace since ``since`` is in ``directory``: each GPU's worker writes its own, and
        :func:`read_profile` picks among them."""
        return len(traces_since(directory, since, pattern)) >= self.spec.tensor_parallel_size

    def run(self, workload: Workload, plan: MeasurePlan) -> dict:
        if isinstance(workload, DecodeCell):
            return self.decode_cell(workload, plan)
        if isinstance(workload, ThroughputLoad):
            return self.throughput(workload, plan)
        if isinstance(workload, ForcedDecode):
            return self.forced(workload, plan)
        return self.mixed(workload, plan)

    def decode_cell(self, cell: DecodeCell, plan: MeasurePlan) -> dict:
        raise NotImplementedError

    def throughput(self, load: ThroughputLoad, plan: MeasurePlan) -> dict:
        raise NotImplementedError

    def mixed(self, load: MixedLoad, plan: MeasurePlan) -> dict:
        raise NotImplementedError

    def forced(self, load: ForcedDecode, plan: MeasurePlan) -> dict:
        raise NotImplementedError

    def verification(self) -> list[dict]:
        """Under ``spec.verify``: each engine process's (rank's) :func:`mla_backend.verify.verification_report`
        with its ``rank``, after the workloads; empty where our backend never ran."""
        raise NotImplementedError

    def host_timings(self) -> list[dict] | None:
        """Each rank's host timers since the last call (``{"rank", "ranges"}``, host_trace.host_timings), resetting
        them; None where the engine has no way to read them."""
        return None

    def decode_inputs(self, cell: DecodeCell, plan: MeasurePlan) -> tuple[list, int]:
        """A decode cell's prompts and the tokens each request generates (its windows, within the model length)."""
        prompts = token_prompts(cell.batch, cell.context, self.spec.vocab_size, prompt_seed(cell, plan))
        return prompts, min(decode_max_tokens(cell, plan, self.prefill_chunk_tokens),
                            self.spec.max_model_len - cell.context - self.reserved_tokens)

    def mixed_inputs(self, load: MixedLoad, plan: MeasurePlan) -> tuple[list, list, int]:
        """The mixed load's decoder prompts, long prompts and the tokens each decoder generates."""
        decoder_prompts = token_prompts(load.decoders, load.decoder_context, self.spec.vocab_size,
                                        prompt_seed(load, plan, 0))
        long_prompts = token_prompts(load.long_prompts, load.long_context, self.spec.vocab_size,
                                     prompt_seed(load, plan, 1))
        decoder_tokens = min(mixed_decoder_max_tokens(load, plan, self.prefill_chunk_tokens),
                             self.spec.max_model_len - load.decoder_context - self.reserved_tokens)
        return decoder_prompts, long_prompts, decoder_tokens

    def forced_inputs(self, load: ForcedDecode, plan: MeasurePlan) -> tuple[list, list]:
        """The forced check's prompts (ragged: prompt i has about (i + 1) / prompts of ``context`` tokens) and the
        tokens each request is made to emit, one per step."""
        prompts = token_prompts(load.prompts, load.context, self.spec.vocab_size, prompt_seed(load, plan, 0))
        prompts = [p[: max(1, load.context * (i + 1) // load.prompts)] for i, p in enumerate(prompts)]
        return prompts, token_prompts(load.prompts, load.steps, self.spec.vocab_size, prompt_seed(load, plan, 1))

    def shutdown(self) -> None:
        pass
