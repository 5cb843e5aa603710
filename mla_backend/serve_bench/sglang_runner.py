"""serve-bench's SGLang engine process: one ``sglang.Engine`` with one attention backend, every workload on it.

``python -m mla_backend.serve_bench.sglang_runner SPEC_JSON`` (started by the driver, one process per backend).
SGLang spawns its scheduler, so this module is import-safe (nothing runs outside ``__main__``) and the scheduler's
entry point :func:`scheduler_process` is a module-level function: it registers ``tilelang_mla`` (needed where this
package's entry point is not installed) and, for ``--init scaled``, the scaled dummy weights, then runs SGLang's
scheduler.

Requests go through ``Engine.async_generate``. For the decode cells and the mixed load a few requests are streamed
(the first and the last submitted and some between, stamped on arrival) and the rest run unstreamed: SGLang
prefills every waiting request before it decodes again, so once the last-submitted request has its first token the
whole batch decodes, and the streamed ones time its steps without this process handling every request's every
token. The throughput load is one ``Engine.generate`` call, as SGLang's ``bench_offline_throughput`` times it.
"""

from __future__ import annotations

import asyncio
import getpass
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..host_trace import TIMING
from ..sglang_plugin import BACKEND_NAME, ENV_REPORT
from .measure import TokenTracker
from .random_weights import patch_sglang_dummy_weights
from .runner_common import (WARMUP_PROMPTS, WARMUP_TOKENS, EngineChoice, EngineSession, EngineSpec, OutOfTime,
                            cache_counts, check_deadline, decode_record, engine_process_main, forced_record,
                            measurement, mixed_repeat, read_profile)
from .sglang_timers import read_host_timings, time_attention_backends
from .workloads import (DecodeCell, ForcedDecode, MeasurePlan, MixedLoad, ThroughputLoad, prompt_seed,
                        token_prompts)

#: Page 64 for every backend (FlashMLA's only size; SGLang does not pick one for an out-of-tree backend).
ENGINE = EngineChoice("sglang", "mla_backend.serve_bench.sglang_runner",
                      ("tilelang_mla", "flashmla", "fa3", "triton", "flashinfer"),
                      {"auto": "auto", "fp8": "fp8_e4m3"}, page_size=64)
INIT_ENV = "MLA_SERVE_BENCH_INIT"  # read by the scheduler processes
STREAMED_REQUESTS = 8
POLL_S = 0.001
PROFILE_POLL_S = 0.05
PROFILE_WAIT_S = 30.0  # for the trace file after the profiled steps
ABORT_WAIT_S = 60.0
#: SGLang's speculative algorithm for DeepSeek's MTP layer (it loads the layer from the target's own checkpoint).
MTP_ALGORITHM = "EAGLE"
#: The MTP draft's attention backend when ours is the target's: SGLang 0.5.17's draft worker builds its backend from
#: a table of built-ins only, and flashmla takes the same page size (the flashmla engine drafts on flashmla too).
OURS_DRAFT_BACKEND = "flashmla"
#: Newer SGLang's width of attention data parallelism; older ones spell it enable_dp_attention with dp_size.
ATTENTION_DP_FIELD = "attn_dp_size"


def server_arg_fields() -> set[str] | None:
    """The keyword arguments the installed SGLang's ServerArgs takes, or None where SGLang is not installed."""
    if importlib.util.find_spec("sglang") is None:
        return None
    from sglang.srt.server_args import ServerArgs

    return set(inspect.signature(ServerArgs).parameters)


def parallel_kwargs(spec: EngineSpec, fields: set[str] | None = None) -> dict:
    """Tensor parallelism, DP attention and MTP speculative decoding as ServerArgs arguments.

    DP attention: one attention replica per GPU (``tp_size`` of them), each with all heads and its own requests;
    ``attn_dp_size`` where ServerArgs has it, else the older ``enable_dp_attention`` with ``dp_size``. MTP: EAGLE
    with DeepSeek's MTP layer as the draft, one draft token per step in a chain (``speculative_eagle_topk`` 1), so
    ``speculative_num_draft_tokens`` = steps + 1 queries per request are verified, as SGLang documents for DeepSeek."""
    tp = spec.tensor_parallel_size
    kwargs: dict = {"tp_size": tp}
    if spec.dp_attention:
        fields = server_arg_fields() if fields is None else fields
        if fields is not None and ATTENTION_DP_FIELD in fields:
            kwargs[ATTENTION_DP_FIELD] = tp
        else:
            kwargs.update(enable_dp_attention=True, dp_size=tp)
    if spec.speculative_tokens:
        kwargs.update(speculative_algorithm=MTP_ALGORITHM, speculative_num_steps=spec.speculative_tokens,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=spec.speculative_tokens + 1)
        if spec.backend == BACKEND_NAME:
            kwargs["speculative_draft_attention_backend"] = OURS_DRAFT_BACKEND
    return kwargs


def max_running_requests(spec: EngineSpec) -> int:
    """The engine's request limit: the largest batch, under DP attention rounded up to a multiple of the attention
    replicas. SGLang gives each replica ``max_running_requests // replicas`` (and refuses to start one with none);
    its round-robin dispatch hands a replica up to ceil(batch / replicas) requests, which must all run at once."""
    replicas = spec.parallel.attention_data_parallel_size
    return -(-spec.max_num_seqs // replicas) * replicas


def server_kwargs(spec: EngineSpec, fields: set[str] | None = None) -> dict:
    """The ``sglang.Engine`` / ``ServerArgs`` arguments: dummy weights, token-id prompts, radix (prefix) cache off,
    fixed seed, the backend under test, CUDA graphs up to the largest batch, the parallel layout (``fields``: the
    ServerArgs arguments, default the installed SGLang's)."""
    kwargs = dict(model_path=spec.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  attention_backend=spec.backend, page_size=spec.page_size, kv_cache_dtype=spec.kv_cache_dtype,
                  disable_radix_cache=True, random_seed=spec.measure_plan.seed,
                  mem_fraction_static=spec.gpu_memory_fraction, context_length=spec.max_model_len,
                  max_running_requests=max_running_requests(spec), cuda_graph_max_bs_decode=spec.max_num_seqs,
                  disable_shared_experts_fusion=True, log_level="warning", **parallel_kwargs(spec, fields))
    if spec.forces_tokens:
        kwargs["enable_custom_logit_processor"] = True  # the forced check's (forced_tokens_processor)
    if spec.verify:
        kwargs["disable_cuda_graph"] = True  # a call inside a CUDA graph cannot be checked (verify.py)
    return kwargs


def backend_report_dir(spec: EngineSpec) -> str:
    """Where our backend's processes write their reports (``MLA_BACKEND_SGLANG_REPORT``) under ``spec.verify``."""
    return spec.result_path + ".backend-reports"


def read_verification(report_dir: str) -> list[dict]:
    """One verification report per process that ran our backend (each tensor-parallel rank's scheduler), from the
    newest report file of that process (every backend object of a process, the MTP draft's included, reports the
    process's one set of counters), with the process's TP rank as ``rank``."""
    newest: dict[int, tuple[float, dict]] = {}
    for path in Path(report_dir).glob("*.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "mla_backend_verify" in report:
            mtime = path.stat().st_mtime
            if report["pid"] not in newest or mtime > newest[report["pid"]][0]:
                newest[report["pid"]] = (mtime, dict(report["mla_backend_verify"], pid=report["pid"],
                                                     rank=report.get("tp_rank")))
    return sorted((report for _, report in newest.values()), key=lambda r: (r["rank"] is None, r["rank"], r["pid"]))


def forced_tokens_processor():
    """A ``CustomLogitProcessor`` for teacher forcing (SGLang serialises it by value into its scheduler processes):
    per request with ``custom_params`` ``{"forced": [...], "record_dir": d, "index": i}``, it appends "step argmax"
    (the model's own choice) to ``d/<i>.txt``, then leaves only the scripted token. Each tensor-parallel rank writes
    the same lines; :func:`read_forced_argmax` keeps one per step."""
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    class ForcedTokens(CustomLogitProcessor):
        steps: dict = {}  # request id -> steps seen (per scheduler process)

        @staticmethod
        def middle_chunk(req) -> bool:
            """A prefill chunk that ends before the prompt does (chunked prefill): SGLang samples its last row and
            drops the token, so it is no step. The prompt's filled end: ``extend_range.end`` (SGLang 0.5.17),
            ``extend_end`` (0.5.23)."""
            if len(req.output_ids):
                return False
            extend = getattr(req, "extend_range", None)
            filled = extend.end if extend is not None else getattr(req, "extend_end", None)
            return filled is not None and filled < len(req.origin_input_ids)

        def __call__(self, logits, custom_param_list=None):
            import os as _os

            best = logits.argmax(dim=-1).tolist()
            for row, params in enumerate(custom_param_list or []):
                req, forced = params["__req__"], params["forced"]
                if ForcedTokens.middle_chunk(req):
                    continue
                step = ForcedTokens.steps.get(req.rid, 0)
                ForcedTokens.steps[req.rid] = step + 1
                if step < len(forced):  # the overlap scheduler may run a finished request once more
                    with open(_os.path.join(params["record_dir"], f"{params['index']}.txt"), "a") as f:
                        f.write(f"{step} {best[row]}\n")
                logits[row].fill_(float("-inf"))
                logits[row, forced[min(step, len(forced) - 1)]] = 0.0
            return logits

    return ForcedTokens


def read_forced_argmax(record_dir: str, requests: int) -> list[list[int]]:
    """Per request, the argmax of each step as :func:`forced_tokens_processor` recorded it."""
    argmax = []
    for index in range(requests):
        steps: dict[int, int] = {}
        path = os.path.join(record_dir, f"{index}.txt")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    step, token = line.split()
                    steps[int(step)] = int(token)
        argmax.append([steps[k] for k in sorted(steps)])
    return argmax


def prepare_process() -> None:
    """In every SGLang process of the run: our backend registered, and the scaled weights where asked for."""
    from mla_backend.sglang_plugin import register

    register()
    if os.environ.get(INIT_ENV) == "scaled":
        patch_sglang_dummy_weights(None)


def scheduler_process(*args, **kwargs):
    """The scheduler subprocess's target (spawned: module level, so it pickles by reference); under
    ``MLA_BACKEND_HOST_TIMERS=1`` it times every attention backend (sglang_timers.py)."""
    prepare_process()
    time_attention_backends()
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process(*args, **kwargs)


def bench_engine_class():
    """``sglang.Engine`` whose scheduler processes run :func:`scheduler_process`."""
    from sglang.srt.entrypoints.engine import Engine

    class BenchEngine(Engine):
        run_scheduler_process_func = staticmethod(scheduler_process)

    return BenchEngine


#: The resolved settings a run's report records from ``Engine.get_server_info()``.
SERVER_INFO_KEYS = ("attention_backend", "page_size", "kv_cache_dtype", "cuda_graph_max_bs_decode", "cuda_graph_max_bs",
                    "max_running_requests", "context_length", "mem_fraction_static", "disable_cuda_graph",
                    "disable_overlap_schedule", "tp_size", "dp_size", "attn_dp_size", "enable_dp_attention",
                    "speculative_algorithm", "speculative_num_steps", "speculative_num_draft_tokens", "quantization")


def read_server_info(engine, keys) -> tuple[dict, dict]:
    """(the fields of ``keys`` the engine reports, its whole server info); introspection only, so a failure is
    recorded as ``introspection_error`` (and the server info is empty) rather than raised."""
    try:
        server = engine.get_server_info()
    except Exception as e:  # noqa: BLE001 - introspection only
        return {"introspection_error": f"{type(e).__name__}: {e}"}, {}
    return {key: server[key] for key in keys if key in server}, server


def compile_cache_dirs() -> list[str]:
    """The JIT caches an SGLang engine's start and first requests fill on a machine where none has started: Triton's
    (SGLang's Triton kernels), FlashInfer's, TorchInductor's, DeepGEMM's, TileLang's (our kernels, seeded from the
    package) and tvm-ffi's (SGLang's own JIT kernels, e.g. the fp8 KV-cache write, built in the first forward)."""
    home = os.path.expanduser("~")
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (containers without a passwd entry)
        user = "unknown"
    return [os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"),
            os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE") or home, ".cache", "flashinfer"),
            os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
            os.environ.get("DG_JIT_CACHE_DIR") or os.path.join(home, ".deep_gemm"),
            os.environ.get("TILELANG_CACHE_DIR") or os.path.join(home, ".tilelang", "cache"),
            os.path.expanduser(os.environ.get("TVM_FFI_CACHE_DIR") or os.path.join(home, ".cache", "tvm-ffi"))]


def streamed_indices(count: int, streamed: int = STREAMED_REQUESTS) -> list[int]:
    """Which of ``count`` requests are streamed: evenly spread, always the first and the last."""
    if count <= streamed:
        return list(range(count))
    return sorted({round(i * (count - 1) / (streamed - 1)) for i in range(streamed)})


class SglangSession(EngineSession):
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.engine = None
        self._rids: dict[asyncio.Future, str] = {}  # each submitted request's task -> its SGLang request id
        self._submitted = 0

    # ------------------------------------------------------------------------- start
    def start(self) -> dict:
        os.environ[INIT_ENV] = self.spec.init
        if self.spec.verify:  # the scheduler processes inherit it
            os.environ[ENV_REPORT] = backend_report_dir(self.spec)
        prepare_process()
        import sglang

        if importlib.util.find_spec("tilelang") is not None:
            from ..kernels import prebuilt

            prebuilt.seed_all()  # the package's kernels copied now, so the cache grows at start only by compiles
        self.cached_before = self.compile_cache_counts()
        t0 = time.perf_counter()
        self.engine = bench_engine_class()(**server_kwargs(self.spec))
        info = {"sglang": sglang.__version__, "start_s": round(time.perf_counter() - t0, 1)}
        info.update(self._introspect())
        self.kv_capacity_tokens = info.get("kv_capacity_tokens")
        self.prefill_chunk_tokens = info.get("prefill_chunk_tokens") or self.prefill_chunk_tokens
        # EAGLE stores its draft tokens in each request's output slots, so SGLang counts them against the context
        self.reserved_tokens = int(getattr(self.engine.tokenizer_manager, "num_reserved_tokens", 0) or 0)
        return info

    def _introspect(self) -> dict:
        info, server = read_server_info(self.engine, SERVER_INFO_KEYS)
        if server:
            per_rank = server.get("max_total_num_tokens")
            # under DP attention each GPU's pool holds its own share of the requests: the run holds dp_size times one
            # rank's tokens (SGLang reports one rank's)
            replicas = self.spec.parallel.attention_data_parallel_size
            info["kv_capacity_tokens"] = per_rank * replicas if per_rank else per_rank
            chunk = server.get("chunked_prefill_size")
            info["prefill_chunk_tokens"] = chunk if chunk and chunk > 0 else None
        return info

    def compile_cache_counts(self) -> dict[str, int]:
        return cache_counts(compile_cache_dirs())

    def warmup(self) -> None:
        prompts = self.warmup_prompts()
        self.engine.generate(input_ids=prompts, sampling_params=_sampling(WARMUP_TOKENS))

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def host_timings(self) -> list[dict] | None:
        if not TIMING:
            return None
        _, server = read_server_info(self.engine, ())
        return read_host_timings(server) or None

    def verification(self) -> list[dict]:
        return read_verification(backend_report_dir(self.spec))

    # ------------------------------------------------------------------------- requests
    def _run(self, coroutine):
        return self.engine.loop.run_until_complete(coroutine)

    async def _streamed(self, tracker: TokenTracker, key: str, prompt, max_new_tokens: int, rid: str) -> None:
        tracker.submit(key, time.monotonic())
        chunks = await self.engine.async_generate(input_ids=prompt, sampling_params=_sampling(max_new_tokens),
                                                  stream=True, rid=rid)
        async for chunk in chunks:
            meta = chunk.get("meta_info") or {}
            tracker.record(key, time.monotonic(), int(meta.get("completion_tokens") or 0),
                           finished=meta.get("finish_reason") is not None)

    async def _unstreamed(self, prompt, max_new_tokens: int, rid: str) -> None:
        await self.engine.async_generate(input_ids=prompt, sampling_params=_sampling(max_new_tokens), rid=rid)

    def _launch(self, tracker: TokenTracker, prompts, max_new_tokens: int, tag: str,
                stream_all: bool = False) -> tuple[list[str], list[asyncio.Task]]:
        """Submits the prompts in order; returns the streamed requests' keys and every request's task. Each request
        has its own SGLang request id, which :meth:`_abort` aborts."""
        streamed = set(range(len(prompts))) if stream_all else set(streamed_indices(len(prompts)))
        keys, tasks = [], []
        for i, prompt in enumerate(prompts):
            self._submitted += 1
            rid = f"serve-bench-{tag}-{i}-{self._submitted}"
            if i in streamed:
                keys.append(f"{tag}-{i}")
                tasks.append(asyncio.ensure_future(self._streamed(tracker, keys[-1], prompt, max_new_tokens, rid)))
            else:
                tasks.append(asyncio.ensure_future(self._unstreamed(prompt, max_new_tokens, rid)))
            self._rids[tasks[-1]] = rid
        return keys, tasks

    async def _wait_for(self, condition, what: str, tasks, poll_s: float = POLL_S) -> None:
        while not condition():
            check_deadline(self.spec)
            if all(t.done() for t in tasks):
                errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
                raise RuntimeError(f"every request ended before {what}" + (f": {errors[0]!r}" if errors else ""))
            await asyncio.sleep(poll_s)

    async def _wait_progress(self, tracker: TokenTracker, base: dict[str, int], tokens: int, what: str,
                             tasks) -> None:
        await self._wait_for(lambda: tracker.min_progress(base) >= tokens, what, tasks)

    async def _abort(self, tasks) -> None:
        """Aborts the running requests of ``tasks`` by their ids and waits for the tasks to end. Not ``abort_all``:
        under DP attention that reaches the schedulers through the DP controller, late enough to abort the next
        workload's requests too."""
        for t in tasks:
            rid = self._rids.pop(t, None)
            if rid is not None and not t.done():
                self.engine.tokenizer_manager.abort_request(rid=rid)
        pending = [t for t in tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=ABORT_WAIT_S)
            for t in still:
                t.cancel()
        for t in tasks:  # retrieve aborted requests' exceptions, so that asyncio does not report them
            if t.done() and not t.cancelled():
                t.exception()

    async def _profile(self, plan: MeasurePlan, label: str, tasks) -> dict:
        """Profiles the next ``profile_steps`` forward steps (SGLang's profiler stops itself) and reads the
        traces, one per GPU (runner_common.read_profile); a failure is recorded as ``{"error"}``, since the timed
        measurements stand without it."""
        from sglang.srt.managers.io_struct import ProfileReq

        try:
            since = time.time()
            directory = self.spec.profile_dir
            pattern = f"{label}*.trace.json*"
            await self.engine.tokenizer_manager.start_profile(ProfileReq(
                output_dir=os.path.abspath(directory), num_steps=plan.profile_steps, activities=["GPU"],
                with_stack=False, record_shapes=False, profile_id=label))
            deadline = time.monotonic() + PROFILE_WAIT_S
            await self._wait_for(lambda: self.traces_written(directory, since, pattern) or time.monotonic() > deadline,
                                 "the profiler traces were written", tasks, PROFILE_POLL_S)
            return read_profile(directory, since, plan.profile_steps, pattern)
        except OutOfTime:
            raise
        except Exception as e:  # noqa: BLE001 - the timed measurements stand without it
            return {"error": f"{type(e).__name__}: {e}"}

    # ------------------------------------------------------------------------- workloads
    def decode_cell(self, cell: DecodeCell, plan: MeasurePlan) -> dict:
        prompts, max_new = self.decode_inputs(cell, plan)
        return self._run(self._decode_cell(cell, plan, prompts, max_new))

    async def _decode_cell(self, cell: DecodeCell, plan: MeasurePlan, prompts, max_new: int) -> dict:
        tracker = TokenTracker()
        submitted = time.monotonic()
        keys, tasks = self._launch(tracker, prompts, max_new, f"b{cell.batch}c{cell.context}")
        profile = None
        try:
            await self._wait_for(lambda: tracker.all_started(keys), "the batch was prefilled", tasks)
            prefill_s = time.monotonic() - submitted
            base = tracker.counts(keys)
            await self._wait_progress(tracker, base, plan.warmup_steps + plan.repeats * plan.window_steps,
                                      "the timed windows", tasks)
            if plan.profile_steps:
                profile = await self._profile(plan, f"decode-b{cell.batch}-c{cell.context}", tasks)
        finally:
            await self._abort(tasks)
        return decode_record(cell, plan, tracker.subset(keys), base, profile, prefill_s)

    def throughput(self, load: ThroughputLoad, plan: MeasurePlan) -> dict:
        prompts = token_prompts(load.prompts, load.input_len, self.spec.vocab_size, prompt_seed(load, plan))
        sampling = _sampling(load.output_len)
        self.engine.generate(input_ids=prompts[:WARMUP_PROMPTS], sampling_params=sampling)  # same shapes, untimed
        repeats = []
        for _ in range(plan.repeats):
            check_deadline(self.spec)
            t0 = time.perf_counter()
            outputs = self.engine.generate(input_ids=prompts, sampling_params=sampling)
            seconds = time.perf_counter() - t0
            output_tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outputs)
            repeats.append({"output_tok_per_s": output_tokens / seconds,
                            "total_tok_per_s": (output_tokens + load.prompts * load.input_len) / seconds,
                            "wall_s": seconds})
        return measurement(load, repeats)

    def mixed(self, load: MixedLoad, plan: MeasurePlan) -> dict:
        decoder_prompts, long_prompts, decoder_tokens = self.mixed_inputs(load, plan)
        repeats = [self._run(self._mixed(load, plan, r, decoder_prompts, long_prompts, decoder_tokens))
                   for r in range(plan.repeats)]
        if not plan.profile_steps:
            return measurement(load, repeats)
        profile = self._run(self._mixed_profile(plan, decoder_prompts, long_prompts[0], decoder_tokens))
        return measurement(load, repeats, profile=profile)

    async def _mixed_warm_up(self, tracker: TokenTracker, decoders: list[str], plan: MeasurePlan, tasks) -> dict:
        """The mixed load up to its first arrival: the decoders prefilled and through the warm-up steps. Returns their
        token counts after the prefill."""
        await self._wait_for(lambda: tracker.all_started(decoders), "the decoders were prefilled", tasks)
        base = tracker.counts(decoders)
        await self._wait_progress(tracker, base, plan.warmup_steps, "the warm-up", tasks)
        return base

    async def _mixed_profile(self, plan: MeasurePlan, decoder_prompts, long_prompt, decoder_tokens: int) -> dict:
        """An untimed pass of the mixed load whose profiled steps start at the first long prompt's arrival (its
        prefill chunks among the decoders' steps)."""
        tracker = TokenTracker()
        decoders, tasks = self._launch(tracker, decoder_prompts, decoder_tokens, "mixed-profile-decode")
        try:
            await self._mixed_warm_up(tracker, decoders, plan, tasks)
            tasks += self._launch(tracker, [long_prompt], plan.long_prompt_tokens, "mixed-profile-long",
                                  stream_all=True)[1]
            return await self._profile(plan, "mixed", tasks)
        finally:
            await self._abort(tasks)

    async def _mixed(self, load: MixedLoad, plan: MeasurePlan, repeat: int, decoder_prompts, long_prompts,
                     decoder_tokens: int) -> dict:
        tracker = TokenTracker()
        decoders, tasks = self._launch(tracker, decoder_prompts, decoder_tokens, f"mixed{repeat}-decode")
        longs: list[str] = []
        try:
            base = await self._mixed_warm_up(tracker, decoders, plan, tasks)
            window_start = time.monotonic()
            for k, prompt in enumerate(long_prompts):
                await self._wait_progress(tracker, base, plan.warmup_steps + k * load.arrival_gap_steps,
                                          "the next arrival", tasks)
                keys, new = self._launch(tracker, [prompt], plan.long_prompt_tokens, f"mixed{repeat}-long{k}",
                                         stream_all=True)
                longs += keys
                tasks += new
            await self._wait_for(lambda: tracker.all_started(longs), "the long prompts' first tokens", tasks)
        finally:
            await self._abort(tasks)
        return mixed_repeat(tracker, decoders, longs, window_start, decoder_count=load.decoders)

    def forced(self, load: ForcedDecode, plan: MeasurePlan) -> dict:
        prompts, scripts = self.forced_inputs(load, plan)
        record_dir = tempfile.mkdtemp(prefix="forced-", dir=os.path.dirname(os.path.abspath(self.spec.result_path)))
        processor = forced_tokens_processor().to_str()
        params = [dict(_sampling(load.steps), custom_params={"forced": script, "record_dir": record_dir, "index": i})
                  for i, script in enumerate(scripts)]
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params,
                                       custom_logit_processor=[processor] * len(prompts))
        held = [list(o["output_ids"]) for o in outputs] == scripts
        return forced_record(load, read_forced_argmax(record_dir, len(prompts)), held)


def _sampling(max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def main(argv: list[str] | None = None) -> int:
    return engine_process_main(SglangSession, argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # leftover SGLang threads must not keep the process (and the GPU) alive
