"""serve-bench's vLLM engine process: one ``vllm.LLM`` with one attention backend, every workload on it.

``python -m mla_backend.serve_bench.vllm_runner SPEC_JSON`` (started by the driver, one process per backend, so each
engine gets a fresh CUDA context). Requests go through the engine's own offline path: ``LLMEngine.add_request`` and
``LLMEngine.step`` (what ``LLM.generate`` runs) for the decode cells and the mixed load, where outputs must be seen
step by step, and ``LLM.generate`` itself for the throughput load. Step times are the engine core's own timestamps
(``RequestOutput.metrics``, kept with ``disable_log_stats=False``), so the time this process spends reading outputs
does not enter them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time

from .. import installed
from .hostile_vllm import mtp_config, rank1_tokens
from .measure import TokenTracker, median_or_none, request_tpots
from .random_weights import vllm_worker_kwargs
from .runner_common import (WARMUP_PROMPTS, WARMUP_TOKENS, EngineChoice, EngineSession, EngineSpec, OutOfTime,
                            cache_counts, check_deadline, decode_record, engine_process_main, forced_record,
                            measurement, mixed_repeat, read_profile)
from .workloads import (DecodeCell, ForcedDecode, MeasurePlan, MixedLoad, ThroughputLoad, prompt_seed,
                        token_prompts)

#: Ours first, then the built-in MLA backends (FLASH_ATTN_MLA is vLLM 0.26's default on Hopper); page 64 for every
#: backend: FlashMLA's only size, the one ours is fastest with.
ENGINE = EngineChoice("vllm", "mla_backend.serve_bench.vllm_runner",
                      ("CUSTOM", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA", "FLASHINFER_MLA"),
                      {"auto": "auto", "fp8": "fp8"}, page_size=64)
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = "mla_backend.vllm_plugin:register"
#: EngineArgs' field for decode context parallelism (not in every vLLM release).
DECODE_CONTEXT_PARALLEL_FIELD = "decode_context_parallel_size"
#: vLLM's speculative method that drafts with DeepSeek-V3's own MTP layer (num_nextn_predict_layers in the config).
MTP_METHOD = "deepseek_mtp"
TRACE_PATTERN = "*.pt.trace.json*"
PROFILE_WAIT_S = 30.0  # for the trace file after the profiled steps


def entry_point_installed() -> bool:
    """Whether vLLM's plugin loader will find this package's plugin in the engine's own processes."""
    from importlib.metadata import entry_points

    return any(ep.value == ENTRY_POINT for ep in entry_points(group=ENTRY_POINT_GROUP))


def needs_in_process() -> bool:
    """The engine core must run in the benchmark's process when no entry point registers the plugin in a separate
    engine-core process (a source checkout that is not installed). One mode for every backend of a run, so that they
    are compared alike."""
    return not entry_point_installed()


def profiler_config(spec: EngineSpec):
    """torch.profiler in the worker, GPU kernels only, stopping itself after ``profile_steps`` engine steps."""
    from vllm.config import ProfilerConfig

    return ProfilerConfig(profiler="torch", torch_profiler_dir=os.path.abspath(spec.profile_dir),
                          torch_profiler_with_stack=False, torch_profiler_dump_cuda_time_total=False,
                          torch_profiler_record_shapes=False, max_iterations=spec.measure_plan.profile_steps)


def engine_arg_fields() -> set[str] | None:
    """The fields of the installed vLLM's EngineArgs, or None where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def decode_context_parallel_problem(fields: set[str] | None) -> str | None:
    """Why ``--decode-context-parallel-size`` cannot be passed to this vLLM, or None."""
    if fields is None:
        return "--decode-context-parallel-size needs vLLM installed (pip install -e \".[vllm]\")"
    if DECODE_CONTEXT_PARALLEL_FIELD not in fields:
        return (f"--decode-context-parallel-size: vLLM {installed.version('vllm')}'s EngineArgs has no "
                f"{DECODE_CONTEXT_PARALLEL_FIELD}; supported only where it has")
    return None


def parallel_kwargs(spec: EngineSpec, fields: set[str] | None = None) -> dict:
    """Tensor parallelism, MTP speculative decoding and decode context parallelism, as EngineArgs arguments (only
    those that differ from vLLM's defaults). The MTP layer runs on the backend under test too (``mtp_config``): every
    attention call of the engine, draft and verification, runs on that backend."""
    kwargs: dict = {"tensor_parallel_size": spec.tensor_parallel_size}
    if spec.speculative_tokens:
        kwargs["speculative_config"] = mtp_config(spec.speculative_tokens, spec.backend, MTP_METHOD)
    if spec.decode_context_parallel_size > 1:
        problem = decode_context_parallel_problem(engine_arg_fields() if fields is None else fields)
        if problem:
            raise ValueError(problem)
        kwargs[DECODE_CONTEXT_PARALLEL_FIELD] = spec.decode_context_parallel_size
    return kwargs


def engine_kwargs(spec: EngineSpec) -> dict:
    """The ``vllm.LLM`` / ``EngineArgs`` arguments: dummy weights, token-id prompts, prefix caching off, fixed seed,
    the backend under test, stats kept (the per-request step timestamps come from them), the parallel layout."""
    kwargs = dict(model=spec.model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=spec.measure_plan.seed,
                  load_format="dummy", attention_backend=spec.backend, block_size=spec.page_size,
                  kv_cache_dtype=spec.kv_cache_dtype,
                  enable_prefix_caching=False, gpu_memory_utilization=spec.gpu_memory_fraction,
                  max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs, disable_log_stats=False,
                  **parallel_kwargs(spec))
    # every worker extended: the scaled weights where asked, and the per-rank reports (verification, host timers)
    kwargs.update(vllm_worker_kwargs(scaled=spec.init == "scaled"))
    if spec.verify:
        kwargs["enforce_eager"] = True  # a call inside a CUDA graph cannot be checked (verify.py)
    if spec.measure_plan.profile_steps:
        kwargs["profiler_config"] = profiler_config(spec)
    if spec.forces_tokens:
        from .vllm_forcing import FORCE_TOKENS

        kwargs["logits_processors"] = [FORCE_TOKENS]  # a no-op for requests without a script
    return kwargs


def compile_cache_counts() -> dict[str, int]:
    """Files in vLLM's torch.compile cache (``VLLM_CACHE_ROOT/torch_compile_cache``): more after an engine's start than
    before it means that engine compiled its graphs in its own process."""
    import vllm.envs as envs

    return cache_counts([os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache")])


class VllmSession(EngineSession):
    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.llm = None
        self.engine = None

    # ------------------------------------------------------------------------- start
    def start(self) -> dict:
        if self.spec.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if self.spec.tensor_parallel_size > 1:
                # the TP workers must inherit this process's registration of our backend: forked, vLLM's default,
                # which it replaces by spawn only when CUDA is already initialised here
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        import vllm
        from vllm import LLM

        if self.spec.in_process:
            from mla_backend.vllm_plugin import register

            register()  # without the entry point nothing else would (one process: this registration is seen)
        self.cached_before = self.compile_cache_counts()
        t0 = time.perf_counter()
        self.llm = LLM(**engine_kwargs(self.spec))
        self.engine = self.llm.llm_engine
        info = {"vllm": vllm.__version__, "start_s": round(time.perf_counter() - t0, 1),
                "engine_process": "in-process" if self.spec.in_process else "multiprocess"}
        info.update(self._introspect())
        self.kv_capacity_tokens = info.get("kv_capacity_tokens")
        self.prefill_chunk_tokens = info.get("prefill_chunk_tokens") or self.prefill_chunk_tokens
        return info

    def _introspect(self) -> dict:
        """The settings the engine resolved (introspection only: a missing attribute is not an error)."""
        info = {}
        try:
            cfg = self.engine.vllm_config
            info["block_size"] = cfg.cache_config.block_size
            # every TP GPU holds every request's latent rows (MLA's cache is not split by heads); under decode
            # context parallelism each holds 1/N of each request's tokens, so N times as many fit
            info["kv_capacity_tokens"] = (cfg.cache_config.num_gpu_blocks * cfg.cache_config.block_size
                                          * self.spec.decode_context_parallel_size)
            info["kv_cache_dtype"] = str(cfg.cache_config.cache_dtype)
            info["prefill_chunk_tokens"] = cfg.scheduler_config.max_num_batched_tokens
            info["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
            info["max_model_len"] = cfg.model_config.max_model_len
            info["cudagraph_mode"] = str(cfg.compilation_config.cudagraph_mode)
            info["attention_backend"] = str(cfg.attention_config.backend)
            info["async_scheduling"] = getattr(cfg.scheduler_config, "async_scheduling", None)
            info["tensor_parallel_size"] = cfg.parallel_config.tensor_parallel_size
            info["decode_context_parallel_size"] = getattr(cfg.parallel_config, DECODE_CONTEXT_PARALLEL_FIELD, None)
            spec_config = cfg.speculative_config
            info["speculative_tokens"] = spec_config.num_speculative_tokens if spec_config else 0
            if spec_config is not None:  # the MTP layer's backend (None: vLLM picked its own)
                backend = getattr(spec_config, "attention_backend", None)
                info["draft_attention_backend"] = getattr(backend, "name", backend)
            info["quantization"] = cfg.model_config.quantization
        except Exception as e:  # noqa: BLE001
            info["introspection_error"] = f"{type(e).__name__}: {e}"
        return info

    def compile_cache_counts(self) -> dict[str, int]:
        return compile_cache_counts()

    def warmup(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = self.warmup_prompts()
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=False),
                          use_tqdm=False)

    def shutdown(self) -> None:
        self.engine = self.llm = None

    def _per_rank(self, method: str, **kwargs) -> list[dict]:
        """Every worker's answer to one of the worker extension's methods, those that have one."""
        return [r for r in self.llm.collective_rpc(method, kwargs=kwargs) if r is not None]

    def verification(self) -> list[dict]:
        from .vllm_worker_extension import VERIFICATION_RPC

        return self._per_rank(VERIFICATION_RPC)

    def host_timings(self) -> list[dict] | None:
        from .vllm_worker_extension import HOST_TIMINGS_RPC

        return self._per_rank(HOST_TIMINGS_RPC, reset=True) or None

    # ------------------------------------------------------------------------- step loop
    def _submit(self, tracker: TokenTracker, prompts, max_tokens: int, tag: str) -> list[str]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        keys = []
        for i, prompt in enumerate(prompts):
            key = f"{tag}-{i}"
            tracker.submit(key, time.monotonic())
            self.engine.add_request(key, TokensPrompt(prompt_token_ids=prompt), params)
            keys.append(key)
        return keys

    def _step(self, tracker: TokenTracker) -> None:
        """One ``LLMEngine.step``: each request's new tokens, stamped with the engine core's time of that step."""
        check_deadline(self.spec)
        outputs = self.engine.step()
        if outputs:
            tracker.steps += 1
        for out in outputs:
            series = tracker.requests.get(out.request_id)
            tokens = (series.count if series else 0) + sum(len(c.token_ids) for c in out.outputs)  # DELTA outputs
            stats = out.metrics
            stamp = getattr(stats, "last_token_ts", 0.0) or time.monotonic()
            ttft = getattr(stats, "first_token_latency", 0.0) or None
            tracker.record(out.request_id, stamp, tokens, finished=out.finished, engine_ttft=ttft)

    def _step_until(self, tracker: TokenTracker, condition, what: str) -> None:
        while not condition():
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"every request finished before {what}")
            self._step(tracker)

    def _step_until_progress(self, tracker: TokenTracker, base: dict[str, int], tokens: int, what: str) -> None:
        """Steps until every request in ``base`` has ``tokens`` more tokens than its count there."""
        self._step_until(tracker, lambda: tracker.min_progress(base) >= tokens, what)

    def _finish(self, keys) -> None:
        """Aborts the requests still running and steps until the engine is empty."""
        self.engine.abort_request(list(keys))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def _profile(self, tracker: TokenTracker, plan: MeasurePlan, label: str) -> dict:
        """Profiles the next ``profile_steps`` engine steps (the profiler stops itself) and reads the traces,
        one per GPU (runner_common.read_profile); a failure is recorded as ``{"error"}``, since the timed
        measurements stand without it."""
        try:
            since = time.time()
            self.engine.start_profile(label)
            start_steps = tracker.steps
            deadline = time.monotonic() + PROFILE_WAIT_S
            directory = self.spec.profile_dir
            while not self.traces_written(directory, since, TRACE_PATTERN) and time.monotonic() < deadline:
                if tracker.steps - start_steps > plan.profile_steps + 8 or not self.engine.has_unfinished_requests():
                    time.sleep(0.2)  # the steps ran; the worker is writing the trace
                else:
                    self._step(tracker)
            self.engine.stop_profile()  # re-arms the profiler (after a self-stop it still counts as active)
            return read_profile(directory, since, plan.profile_steps, TRACE_PATTERN)
        except OutOfTime:
            raise
        except Exception as e:  # noqa: BLE001 - the timed measurements stand without it
            return {"error": f"{type(e).__name__}: {e}"}

    # ------------------------------------------------------------------------- workloads
    def decode_cell(self, cell: DecodeCell, plan: MeasurePlan) -> dict:
        prompts, max_tokens = self.decode_inputs(cell, plan)
        tracker = TokenTracker()
        submitted = time.monotonic()
        keys = self._submit(tracker, prompts, max_tokens, f"b{cell.batch}c{cell.context}")
        profile = None
        try:
            self._step_until(tracker, lambda: tracker.all_started(keys), "the batch was prefilled")
            prefill_s = time.monotonic() - submitted
            base = tracker.counts(keys)
            self._step_until_progress(tracker, base, plan.warmup_steps + plan.repeats * plan.window_steps,
                                      "the timed windows")
            if plan.profile_steps:
                profile = self._profile(tracker, plan, f"decode-b{cell.batch}-c{cell.context}")
        finally:
            self._finish(keys)
        return decode_record(cell, plan, tracker.subset(keys), base, profile, prefill_s)

    def throughput(self, load: ThroughputLoad, plan: MeasurePlan) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in
                   token_prompts(load.prompts, load.input_len, self.spec.vocab_size, prompt_seed(load, plan))]
        params = SamplingParams(temperature=0.0, max_tokens=load.output_len, ignore_eos=True, detokenize=False)
        self.llm.generate(prompts[:WARMUP_PROMPTS], params, use_tqdm=False)  # the same shapes, untimed
        repeats = []
        for _ in range(plan.repeats):
            check_deadline(self.spec)
            t0 = time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            repeats.append(throughput_repeat(outputs, seconds, load))
        return measurement(load, repeats)

    def mixed(self, load: MixedLoad, plan: MeasurePlan) -> dict:
        decoder_prompts, long_prompts, decoder_tokens = self.mixed_inputs(load, plan)
        repeats = []
        for r in range(plan.repeats):
            tracker = TokenTracker()
            decoders = self._submit(tracker, decoder_prompts, decoder_tokens, f"mixed{r}-decode")
            longs: list[str] = []
            try:
                base = self._mixed_warm_up(tracker, decoders, plan)
                window_start = tracker.latest_time
                for k, prompt in enumerate(long_prompts):
                    self._step_until_progress(tracker, base, plan.warmup_steps + k * load.arrival_gap_steps,
                                              "the next arrival")
                    longs += self._submit(tracker, [prompt], plan.long_prompt_tokens, f"mixed{r}-long{k}")
                self._step_until(tracker, lambda: tracker.all_started(longs), "the long prompts' first tokens")
            finally:
                self._finish(decoders + longs)
            repeats.append(mixed_repeat(tracker, decoders, longs, window_start))
        if not plan.profile_steps:
            return measurement(load, repeats)
        return measurement(load, repeats, profile=self._mixed_profile(plan, decoder_prompts, long_prompts[0],
                                                                      decoder_tokens))

    def _mixed_warm_up(self, tracker: TokenTracker, decoders: list[str], plan: MeasurePlan) -> dict:
        """The mixed load up to its first arrival: the decoders prefilled and through the warm-up steps. Returns their
        token counts after the prefill."""
        self._step_until(tracker, lambda: tracker.all_started(decoders), "the decoders were prefilled")
        base = tracker.counts(decoders)
        self._step_until_progress(tracker, base, plan.warmup_steps, "the warm-up")
        return base

    def _mixed_profile(self, plan: MeasurePlan, decoder_prompts, long_prompt, decoder_tokens: int) -> dict:
        """An untimed pass of the mixed load whose profiled steps start at the first long prompt's arrival (its
        prefill chunks in the decoders' steps)."""
        tracker = TokenTracker()
        keys = self._submit(tracker, decoder_prompts, decoder_tokens, "mixed-profile-decode")
        try:
            self._mixed_warm_up(tracker, keys, plan)
            keys += self._submit(tracker, [long_prompt], plan.long_prompt_tokens, "mixed-profile-long")
            return self._profile(tracker, plan, "mixed")
        finally:
            self._finish(keys)

    def forced(self, load: ForcedDecode, plan: MeasurePlan) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, scripts = self.forced_inputs(load, plan)
        params = [SamplingParams(temperature=0.0, max_tokens=load.steps, ignore_eos=True, detokenize=False, logprobs=1,
                                 extra_args={"force_tokens": script}) for script in scripts]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        held = [list(o.outputs[0].token_ids) for o in outputs] == scripts
        # rank 1 of the raw logprobs: the model's own choice (the forced token is returned beside it)
        argmax = [rank1_tokens(o.outputs[0].logprobs, 0, len(o.outputs[0].logprobs)) for o in outputs]
        return forced_record(load, argmax, held)


def throughput_repeat(outputs, seconds: float, load: ThroughputLoad) -> dict:
    """Output tokens per second of one ``LLM.generate`` call, plus median TPOT / TTFT from the request metrics."""
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    tracker = TokenTracker()
    for o in outputs:
        stats = o.metrics
        if stats is not None and getattr(stats, "first_token_ts", 0.0):
            key = o.request_id
            tracker.record(key, stats.first_token_ts, 1, engine_ttft=getattr(stats, "first_token_latency", None))
            tracker.record(key, stats.last_token_ts, len(o.outputs[0].token_ids))
    tpot = median_or_none(request_tpots(tracker.requests))
    ttft = median_or_none(s.ttft() for s in tracker.requests.values())
    return {"output_tok_per_s": output_tokens / seconds,
            "total_tok_per_s": (output_tokens + load.prompts * load.input_len) / seconds,
            "tpot_ms": tpot * 1e3 if tpot else None, "ttft_ms": ttft * 1e3 if ttft else None,
            "wall_s": seconds}


def main(argv: list[str] | None = None) -> int:
    return engine_process_main(VllmSession, argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # engine threads and atexit hooks must not keep the process (and the GPU) alive
