"""The hostile run's vLLM engine process: ``python -m mla_backend.serve_bench.hostile_vllm SPEC_JSON``.

``load`` mode: one in-process ``vllm.LLM`` (the scaled random weights' load format is registered in this process)
with the backend under test, prefix caching and chunked prefill on, a KV pool of ``num_gpu_blocks_override`` pages,
MTP when asked; requests go in through ``LLMEngine.add_request`` and come out of ``LLMEngine.step`` (DELTA outputs
with the sampled token's logprob), aborts through ``LLMEngine.abort_request``. The engine's own counters (Prometheus,
``LLM.get_metrics``) give preemptions, prefix-cache hits, accepted draft tokens, error finishes and requests with
NaN logits (``VLLM_COMPUTE_NANS_IN_LOGITS=1``).

``forced`` mode: an eager engine with a built-in backend re-runs each survivor's prompt + output as a prompt with
``prompt_logprobs=1`` and records the rank-1 token at every output position.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from .hostile_load import PAGE_TOKENS, HostileLoad, HostileSpec, LoadLedger
from .hostile_process import PROGRESS_EVERY_S, force_survivors, process_main
from .random_weights import vllm_worker_kwargs
from .runner_common import write_result

# The engine's counters read into the report (sums over labels, except request_success by finish reason).
COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            "vllm:corrupted_requests", "vllm:request_success", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def mtp_config(num_tokens: int, backend: str, method: str = "mtp") -> dict:
    """vLLM's speculative config for MTP with ``num_tokens`` drafts, its drafter on ``backend``: vLLM's drafter never
    inherits the target's attention backend (it picks its own, FLASH_ATTN_MLA on Hopper) unless this names one."""
    return {"method": method, "num_speculative_tokens": num_tokens, "attention_backend": backend}


def common_kwargs(spec: HostileSpec, load: HostileLoad) -> dict:
    return dict(model=spec.model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=load.seed,
                attention_backend=spec.backend, block_size=PAGE_TOKENS,
                kv_cache_dtype=spec.kv_cache_dtype, gpu_memory_utilization=spec.gpu_memory_fraction,
                enable_chunked_prefill=True, max_num_batched_tokens=load.chunk_tokens,
                max_num_seqs=load.max_concurrency, disable_log_stats=False, **vllm_worker_kwargs())


def load_engine_kwargs(spec: HostileSpec) -> dict:
    """The engine under the hostile load: prefix caching on, a pool of ``pool_tokens`` (preemption), full CUDA
    graphs as served, MTP (its drafter on the same backend) when the load asks for it."""
    load = spec.hostile_load
    kwargs = common_kwargs(spec, load)
    kwargs.update(enable_prefix_caching=True, max_model_len=load.max_context,
                  num_gpu_blocks_override=load.pool_tokens // PAGE_TOKENS)
    if load.mtp:
        kwargs["speculative_config"] = mtp_config(1, spec.backend)
    return kwargs


def forced_engine_kwargs(spec: HostileSpec) -> dict:
    """A reference engine: eager (it only prefills), no prefix cache (every position's logits computed), room for
    a full-length sequence plus the one token it generates."""
    load = spec.hostile_load
    kwargs = common_kwargs(spec, load)
    kwargs.update(enable_prefix_caching=False, enforce_eager=True, max_model_len=load.max_context + PAGE_TOKENS)
    return kwargs


def start_engine(kwargs: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine's counters and our plugin live in this process
    os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"  # feeds vllm:corrupted_requests
    from vllm import LLM

    from mla_backend.vllm_plugin import register

    register()
    return LLM(**kwargs)


def read_counters(llm) -> dict[str, float]:
    """The engine's counters by name (``vllm:request_success`` split by finish reason); {} if unreadable."""
    from vllm.v1.metrics.reader import Counter

    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not isinstance(metric, Counter) or metric.name not in COUNTERS:
            continue
        reason = metric.labels.get("finished_reason")
        key = f"{metric.name}{{{reason}}}" if reason else metric.name
        totals[key] = totals.get(key, 0) + metric.value
    return totals


def counter_deltas(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after))}


def engine_report(deltas: dict, aborts_sent: int, readable: bool, note: str = "") -> dict:
    """Preemptions, prefix-cache hits, MTP and the error counters from the counters' change over the load."""
    aborted = deltas.get("vllm:request_success{abort}", 0)
    errors = {"readable": readable, "source": "LLM.get_metrics() over the load",
              "error_finishes": deltas.get("vllm:request_success{error}", 0),
              "nan_logit_requests": deltas.get("vllm:corrupted_requests", 0),
              # abort finishes beyond the ones this process asked for (0 where aborted requests are not counted)
              "unrequested_aborts": max(0, aborted - aborts_sent)}
    if note:
        errors["note"] = note
    return {"preemptions": deltas.get("vllm:num_preemptions") if readable else None,
            "prefix_cache": {"queried_tokens": deltas.get("vllm:prefix_cache_queries"),
                             "hit_tokens": deltas.get("vllm:prefix_cache_hits")},
            "spec_decode": {k.split(":")[1]: v for k, v in deltas.items() if k.startswith("vllm:spec_decode")},
            "engine_errors": errors, "counters": deltas}


# ----------------------------------------------------------------------------- load mode
def sampling_params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=1,
                          output_kind=RequestOutputKind.DELTA)


def sampled_logprobs(completion) -> list[float]:
    """The logprob of each new token (DELTA output), from the logprobs dict vLLM returns per token."""
    steps = completion.logprobs or []
    return [step[token].logprob for step, token in zip(steps, completion.token_ids) if token in step]


def drive_load(engine, ledger: LoadLedger, load: HostileLoad, deadline: float, progress) -> str | None:
    """The step loop: submit what the schedule asks for, step, record, abort; then drain. Returns why it stopped
    early, or None."""
    from vllm.inputs import TokensPrompt

    last_progress = time.monotonic()
    send_end = ledger.send_end
    while True:
        now = time.monotonic()
        for plan in ledger.due(now):
            engine.add_request(plan.key, TokensPrompt(prompt_token_ids=plan.prompt), sampling_params(plan.max_tokens))
        if not ledger.in_flight:
            if not ledger.sending(now):
                return None
            continue
        if now > send_end + load.drain_s or time.time() > deadline:
            return f"still running {now - send_end:.0f} s after sending stopped"
        if not engine.has_unfinished_requests():
            return "the engine holds none of them (dropped)"
        for out in engine.step():
            completion = out.outputs[0]
            ledger.add_tokens(out.request_id, completion.token_ids, sampled_logprobs(completion))
            if out.finished:
                ledger.finish(out.request_id, completion.finish_reason)
        aborts = ledger.aborts_due()
        if aborts:
            engine.abort_request(aborts)
            for key in aborts:
                ledger.finish(key, "abort")
        if now - last_progress > PROGRESS_EVERY_S:
            progress()
            last_progress = now


def run_load(spec: HostileSpec, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    load = spec.hostile_load
    llm = start_engine(load_engine_kwargs(spec))
    result.update(status="running", engine_info=introspect(llm))
    write_result(spec.result_path, result)
    engine = llm.llm_engine
    warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 300)], warmup, use_tqdm=False)  # kernels built before timing
    try:
        before, readable, note = read_counters(llm), True, ""
    except Exception as e:  # noqa: BLE001 - reported as unreadable, which fails the counters check
        before, readable, note = {}, False, f"{type(e).__name__}: {e}"
    ledger = LoadLedger(load, spec.vocab_size, time.monotonic(), spec.sending_s())

    def progress():
        result["records"] = ledger.records
        write_result(spec.result_path, result)

    try:
        stopped = drive_load(engine, ledger, load, spec.deadline, progress)
    except Exception as e:  # noqa: BLE001 - the engine failed under load: everything in flight is lost
        stopped = f"engine error: {type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    ledger.close(stopped or "unfinished")
    aborts_sent = sum(1 for r in ledger.records if r["outcome"] == "aborted")
    after = {}
    if readable:
        try:
            after = read_counters(llm)
        except Exception as e:  # noqa: BLE001
            after, readable, note = {}, False, f"{type(e).__name__}: {e}"
    result.update(engine_report(counter_deltas(before, after) if readable else {}, aborts_sent, readable, note))
    result.update(records=ledger.records, peak_in_flight=ledger.peak_in_flight, sent_s=round(ledger.send_s, 1),
                  stopped_early=stopped,
                  status="failed" if stopped and stopped.startswith("engine error") else "done")


def introspect(llm) -> dict:
    import vllm

    info = {"vllm": vllm.__version__}
    try:
        cfg = llm.llm_engine.vllm_config
        info.update(num_gpu_blocks=cfg.cache_config.num_gpu_blocks, block_size=cfg.cache_config.block_size,
                    prefix_caching=cfg.cache_config.enable_prefix_caching,
                    max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                    chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
                    cudagraph_mode=str(cfg.compilation_config.cudagraph_mode),
                    speculative=str(cfg.speculative_config) if cfg.speculative_config else None)
    except Exception as e:  # noqa: BLE001 - introspection only
        info["introspection_error"] = f"{type(e).__name__}: {e}"
    return info


# ----------------------------------------------------------------------------- forced mode
def rank1_tokens(prompt_logprobs, start: int, stop: int) -> list[int]:
    """The argmax token at prompt positions ``start .. stop-1`` (vLLM's rank 1 of each position's logprobs)."""
    return [next(t for t, lp in prompt_logprobs[p].items() if lp.rank == 1) for p in range(start, stop)]


def run_forced(spec: HostileSpec, result: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = start_engine(forced_engine_kwargs(spec))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)

    def force_batch(prompts):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in prompts], params, use_tqdm=False)
        return [rank1_tokens(out.prompt_logprobs, prompt_len, len(sequence))
                for (sequence, prompt_len), out in zip(prompts, outputs)]

    force_survivors(spec, result, introspect(llm), force_batch)


def main(argv: list[str] | None = None) -> int:
    return process_main("vllm", run_load, run_forced, argv)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # engine teardown can hang; the driver ends the process group
