"""The hostile run's SGLang engine process: ``python -m mla_backend.serve_bench.hostile_sglang SPEC_JSON``.

``load`` mode: one ``sglang.Engine`` (scaled random weights in its scheduler process, as serve-bench's
``--init scaled``) with the backend under test, the radix (prefix) cache on, chunked prefill, a KV pool of
``max_total_tokens`` tokens, EAGLE/MTP (one draft token, drafted on ``triton``: SGLang's draft worker takes only
built-in backends) when asked. Every request is an ``Engine.async_generate`` stream with ``rid`` = its key and the
sampled tokens' logprobs; aborts go through ``tokenizer_manager.abort_request(rid=...)``, the call SGLang's HTTP
server makes when a client goes away. Retractions (SGLang's preemption) come from its Prometheus counters
(``enable_metrics``) and, where those cannot be read, from the scheduler's "#retracted_reqs: N" log lines.

``forced`` mode: an engine without CUDA graphs or radix cache re-runs each survivor's prompt + output with
``return_logprob=True, logprob_start_len=prompt_len - 1, top_logprobs_num=1`` and records the top-1 token at every
output position.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
import traceback

from .hostile_load import PAGE_TOKENS, HostileLoad, HostileSpec, LoadLedger
from .hostile_process import PROGRESS_EVERY_S, force_survivors, process_main
from .runner_common import log_tail, write_result
from .sglang_runner import INIT_ENV, bench_engine_class, prepare_process, read_server_info

MTP_ARGS = dict(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1,
                speculative_num_draft_tokens=2, speculative_draft_attention_backend="triton")
POLL_S = 0.005
RETRACTED_LINE = re.compile(r"#retracted_reqs: (\d+)")
# SGLang admits a request only when its KV (and a share of its remaining output) fits, so a small pool alone seldom
# makes it retract; its own test switch also retracts running requests every this many forward passes.
RETRACT_EVERY_FORWARDS = 100
TRACEBACK_LINE = "Traceback (most recent call last)"
# Prometheus samples read after the load (counters: the sample names carry the _total suffix).
SAMPLES = ("sglang:num_retracted_requests_total", "sglang:num_aborted_requests_total", "sglang:cache_hit_rate",
           "sglang:spec_accept_length")


def common_kwargs(spec: HostileSpec, load: HostileLoad) -> dict:
    return dict(model_path=spec.model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                attention_backend=spec.backend, page_size=PAGE_TOKENS, kv_cache_dtype=spec.kv_cache_dtype,
                random_seed=load.seed, mem_fraction_static=spec.gpu_memory_fraction,
                chunked_prefill_size=load.chunk_tokens, max_running_requests=load.max_concurrency,
                disable_shared_experts_fusion=True, log_level="warning")


def load_server_kwargs(spec: HostileSpec) -> dict:
    """The engine under the hostile load: radix cache on, ``pool_tokens`` of KV (retraction), CUDA graphs up to
    the highest concurrency, metrics on (retraction and abort counters), EAGLE/MTP when the load asks for it. The
    context has a page of headroom: SGLang counts EAGLE's draft tokens against it and refuses a request that fills
    ``max_context`` exactly (seen: "requested a total of 8194 tokens")."""
    load = spec.hostile_load
    kwargs = common_kwargs(spec, load)
    kwargs.update(disable_radix_cache=False, context_length=load.max_context + PAGE_TOKENS,
                  max_total_tokens=load.pool_tokens,
                  cuda_graph_max_bs_decode=load.max_concurrency, enable_metrics=True)
    if load.mtp:
        kwargs.update(MTP_ARGS)
    return kwargs


def forced_server_kwargs(spec: HostileSpec) -> dict:
    """A reference engine: no CUDA graphs (it only prefills), no radix cache, room for a full-length sequence."""
    load = spec.hostile_load
    kwargs = common_kwargs(spec, load)
    kwargs.update(disable_radix_cache=True, disable_cuda_graph=True, context_length=load.max_context + PAGE_TOKENS)
    return kwargs


def start_engine(kwargs: dict, retract_every: int = 0):
    os.environ[INIT_ENV] = "scaled"  # read by prepare_process in every scheduler process
    if retract_every:  # read by the scheduler process at import
        os.environ.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(retract_every))
    prepare_process()
    return bench_engine_class()(**kwargs)


def sampling(max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def merge(previous: list, chunk: list, total: int) -> list:
    """SGLang streams every token so far by default, only the new ones with incremental streaming: a chunk as long
    as the request's token count is the whole list, anything shorter is appended."""
    return list(chunk) if len(chunk) == total else previous + list(chunk)


def finish_type(finish_reason) -> str | None:
    if finish_reason is None:
        return None
    return finish_reason.get("type") if isinstance(finish_reason, dict) else str(finish_reason)


# ----------------------------------------------------------------------------- load mode
async def stream_request(engine, ledger: LoadLedger, plan) -> None:
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = None
    try:
        chunks = await engine.async_generate(input_ids=plan.prompt, sampling_params=sampling(plan.max_tokens),
                                             return_logprob=True, stream=True, rid=plan.key)
        meta: dict = {}
        async for chunk in chunks:
            meta = chunk.get("meta_info") or {}
            total = int(meta.get("completion_tokens") or 0)
            tokens = merge(tokens, chunk.get("output_ids") or [], total)
            logprobs = merge(logprobs, [entry[0] for entry in meta.get("output_token_logprobs") or []], total)
            ledger.set_tokens(plan.key, tokens, logprobs)
            finish = finish_type(meta.get("finish_reason")) or finish
        ledger.prefix_hit_tokens += int(meta.get("cached_tokens") or 0)
        ledger.finish(plan.key, finish)
    except Exception as e:  # noqa: BLE001 - a request the engine failed is a result
        ledger.finish(plan.key, finish, error=f"{type(e).__name__}: {e}")


async def drive_load(engine, ledger: LoadLedger, load: HostileLoad, deadline: float, progress) -> str | None:
    """Submits what the schedule asks for, aborts what is due, waits for the rest; returns why it stopped early."""
    tasks: list[asyncio.Task] = []
    send_end = ledger.send_end
    last_progress = time.monotonic()
    stopped = None
    while True:
        now = time.monotonic()
        for plan in ledger.due(now):
            tasks.append(asyncio.ensure_future(stream_request(engine, ledger, plan)))
        for key in ledger.aborts_due():
            engine.tokenizer_manager.abort_request(rid=key)
        if not ledger.in_flight and not ledger.sending(now):
            break
        if now > send_end + load.drain_s or time.time() > deadline:
            stopped = f"still running {now - send_end:.0f} s after sending stopped"
            break
        if now - last_progress > PROGRESS_EVERY_S:
            progress()
            last_progress = now
        await asyncio.sleep(POLL_S)
    for task in tasks:
        if not task.done():
            task.cancel()
    return stopped


def read_prometheus() -> dict[str, float]:
    """SGLang's Prometheus samples (multiprocess mode: the scheduler writes them under PROMETHEUS_MULTIPROC_DIR)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        raise RuntimeError("PROMETHEUS_MULTIPROC_DIR is not set (metrics off?)")
    registry = CollectorRegistry()
    MultiProcessCollector(registry, directory)
    totals: dict[str, float] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name in SAMPLES:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def log_counts(text: str) -> dict[str, int]:
    """Retractions and tracebacks in the engine's log (the scheduler logs to the same file)."""
    return {"retracted": sum(int(m) for m in RETRACTED_LINE.findall(text)), "tracebacks": text.count(TRACEBACK_LINE)}


def engine_report(before: dict, after: dict, log_text: str, aborts_sent: int, note: str) -> dict:
    deltas = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}
    logged = log_counts(log_text)
    retracted = deltas.get("sglang:num_retracted_requests_total")
    aborted = deltas.get("sglang:num_aborted_requests_total")
    errors = {"readable": True, "source": "Prometheus (enable_metrics) and the engine log over the load",
              "log_tracebacks": logged["tracebacks"],
              # abort counts beyond the ones this process asked for
              "unrequested_aborts": max(0, int(aborted) - aborts_sent) if aborted is not None else 0}
    if note:
        errors["note"] = note
    return {"preemptions": int(retracted) if retracted is not None else logged["retracted"],
            "preemptions_logged": logged["retracted"],
            "prefix_cache": {"hit_rate_last": after.get("sglang:cache_hit_rate"), "hit_tokens": None},
            "spec_decode": {"accept_length_last": after.get("sglang:spec_accept_length")},
            "engine_errors": errors, "counters": deltas}


def run_load(spec: HostileSpec, result: dict) -> None:
    load = spec.hostile_load
    engine = start_engine(load_server_kwargs(spec), RETRACT_EVERY_FORWARDS)
    result.update(status="running", engine_info=introspect(engine))
    write_result(spec.result_path, result)
    engine.generate(input_ids=[[5] * 300], sampling_params=sampling(4))  # kernels built before the load
    note = ""
    try:
        before = read_prometheus()
    except Exception as e:  # noqa: BLE001 - the log still counts retractions
        before, note = {}, f"Prometheus unreadable ({type(e).__name__}: {e}); retractions from the log"
    log_offset = len(log_tail(spec.log_path, 10**9))
    ledger = LoadLedger(load, spec.vocab_size, time.monotonic(), spec.sending_s())

    def progress():
        result["records"] = ledger.records
        write_result(spec.result_path, result)

    try:
        stopped = engine.loop.run_until_complete(drive_load(engine, ledger, load, spec.deadline, progress))
    except Exception as e:  # noqa: BLE001 - the engine failed under load
        stopped = f"engine error: {type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    ledger.close(stopped or "unfinished")
    after = {}
    if before:
        try:
            after = read_prometheus()
        except Exception as e:  # noqa: BLE001
            note = f"Prometheus unreadable after the load ({type(e).__name__}: {e})"
    aborts_sent = sum(1 for r in ledger.records if r["outcome"] == "aborted")
    log_text = log_tail(spec.log_path, 10**9)[log_offset:]
    result.update(engine_report(before, after, log_text, aborts_sent, note))
    result["prefix_cache"]["hit_tokens"] = ledger.prefix_hit_tokens  # meta_info cached_tokens, summed
    result["retract_every_forwards"] = RETRACT_EVERY_FORWARDS
    result.update(records=ledger.records, peak_in_flight=ledger.peak_in_flight, sent_s=round(ledger.send_s, 1),
                  stopped_early=stopped,
                  status="failed" if stopped and stopped.startswith("engine error") else "done")


def introspect(engine) -> dict:
    import sglang

    fields, _ = read_server_info(engine, ("max_total_num_tokens", "chunked_prefill_size", "page_size",
                                          "attention_backend", "disable_radix_cache", "speculative_algorithm",
                                          "speculative_draft_attention_backend", "max_running_requests",
                                          "context_length"))
    return {"sglang": sglang.__version__, **fields}


# ----------------------------------------------------------------------------- forced mode
def top1_tokens(input_top_logprobs: list, count: int) -> list[int]:
    """The top-1 token of the last ``count`` input positions. With ``logprob_start_len = prompt_len - 1`` SGLang
    returns one entry per position from there, the first None (its logits are not computed); entry j predicts the
    token at prompt_len - 1 + j. Each entry lists (logprob, token id, text)."""
    entries = input_top_logprobs[1:1 + count]
    return [int(entry[0][1]) for entry in entries]


def run_forced(spec: HostileSpec, result: dict) -> None:
    engine = start_engine(forced_server_kwargs(spec))

    def force_batch(prompts):
        outputs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=sampling(1), return_logprob=True,
                                  logprob_start_len=[n - 1 for _, n in prompts], top_logprobs_num=1)
        return [top1_tokens(out["meta_info"]["input_top_logprobs"], len(sequence) - prompt_len)
                for (sequence, prompt_len), out in zip(prompts, outputs)]

    force_survivors(spec, result, introspect(engine), force_batch)


def main(argv: list[str] | None = None) -> int:
    return process_main("sglang", run_load, run_forced, argv)


if __name__ == "__main__":  # SGLang spawns its scheduler: the engine must not start on import
    code = main()
    sys.stdout.flush()
    os._exit(code)  # leftover SGLang threads must not keep the process (and the GPU) alive
