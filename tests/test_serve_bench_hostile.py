"""CPU tests of ``mla-backend serve-bench --workloads hostile`` (mla_backend/serve_bench/hostile*.py), short of
running an engine:

* the load: lengths from 1 to the max context, shared prefixes, aborts mid-decode, the concurrency schedule, all
  deterministic by seed, and the errors for settings that cannot work;
* the bookkeeping (:class:`LoadLedger`) driven by a scripted engine written here, and the survivors picked for
  teacher forcing;
* the agreement computation, the verdict and the report;
* the engines' output parsing (SGLang's stream merge and input top-logprobs, vLLM's rank-1 prompt logprobs with
  vLLM's own ``Logprob``);
* the command line: the serve-bench hook, the dry run, bad arguments, exit status 2 without a GPU;
* the engine arguments accepted by vLLM's own ``EngineArgs`` and SGLang's own ``ServerArgs`` (with
  ``PYTHONPATH=.ci/sglang-site``; each skipped where its engine is not importable).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import time

import pytest
import torch

from mla_backend import cli
from mla_backend.serve_bench import hostile, hostile_report
from mla_backend.serve_bench.hostile_load import (ABORTED, COMPLETED, FAILED, FORCED, LOAD, PAGE_TOKENS, UNFINISHED,
                                                  HostileLoad, HostileSpec, LoadLedger, check_load, sending_window,
                                                  concurrency_at, concurrency_schedule, forced_prompt,
                                                  forced_selection, load_from_dict, load_to_dict, plan_request,
                                                  shared_prefixes)
from mla_backend.serve_bench.model_config import write_model_dir

HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
VOCAB = 32000
LOAD_ = HostileLoad(seconds=20, max_context=2048, max_output=64, seed=3)


# ----------------------------------------------------------------------------- the load
def test_requests_are_a_function_of_the_seed_and_the_index():
    prefixes = shared_prefixes(LOAD_, VOCAB)
    again = [plan_request(LOAD_, VOCAB, i) for i in range(40)]
    assert [plan_request(LOAD_, VOCAB, i, prefixes) for i in range(40)] == again
    other = dataclasses.replace(LOAD_, seed=4)
    assert [plan_request(other, VOCAB, i).prompt for i in range(40)] != [p.prompt for p in again]
    assert concurrency_schedule(LOAD_) == concurrency_schedule(dataclasses.replace(LOAD_))
    assert load_from_dict(load_to_dict(LOAD_)) == LOAD_


def test_lengths_span_one_token_to_the_full_context():
    plans = [plan_request(LOAD_, VOCAB, i) for i in range(256)]
    totals = [len(p.prompt) + p.max_tokens for p in plans]
    assert min(len(p.prompt) for p in plans) == 1 and max(totals) == LOAD_.max_context
    assert all(1 <= p.max_tokens <= LOAD_.max_output and t <= LOAD_.max_context for p, t in zip(plans, totals))
    assert sum(t == LOAD_.max_context for t in totals) == 256 // 16  # every 16th fills the context
    assert len({len(p.prompt) for p in plans}) > 100  # and everything in between
    assert all(2 <= tok < VOCAB for p in plans for tok in p.prompt)  # never bos / eos
    short, long_ = sum(len(p.prompt) < 64 for p in plans), sum(len(p.prompt) > LOAD_.max_context // 2 for p in plans)
    assert short > 40 and long_ > 20  # log-uniform: many short ones, a fair number of long ones


def test_prompts_share_prefixes_one_page_aligned_the_others_not():
    prefixes = shared_prefixes(LOAD_, VOCAB)
    assert len(prefixes) == LOAD_.prefix_groups and len(prefixes[0]) == 4 * PAGE_TOKENS
    assert all(len(p) % PAGE_TOKENS for p in prefixes[1:]) and all(len(p) <= LOAD_.max_context // 2 for p in prefixes)
    plans = [plan_request(LOAD_, VOCAB, i, prefixes) for i in range(400)]
    shared = [p for p in plans if p.prefix_group is not None]
    assert 0.2 < len(shared) / len(plans) < LOAD_.prefix_share + 0.1
    assert {p.prefix_group for p in shared} == set(range(LOAD_.prefix_groups))
    for p in shared:
        head = prefixes[p.prefix_group]
        assert p.prompt[:len(head)] == head and len(p.prompt) > len(head)
    none = dataclasses.replace(LOAD_, prefix_share=0.0)
    assert all(plan_request(none, VOCAB, i).prefix_group is None for i in range(100))


def test_aborts_fall_mid_decode():
    plans = [plan_request(LOAD_, VOCAB, i) for i in range(1000)]
    aborted = [p for p in plans if p.abort_after is not None]
    assert all(1 <= p.abort_after < p.max_tokens for p in aborted)
    eligible = sum(p.max_tokens >= 2 for p in plans)
    assert abs(len(aborted) / eligible - LOAD_.abort_share) < 0.05
    assert not any(plan_request(dataclasses.replace(LOAD_, abort_share=0.0), VOCAB, i).abort_after
                   for i in range(100))


def test_concurrency_changes_every_phase_within_the_levels():
    load = dataclasses.replace(LOAD_, seconds=60, phase_s=3, max_concurrency=32)
    schedule = concurrency_schedule(load)
    assert [start for start, _ in schedule] == [3.0 * i for i in range(20)]
    levels = [level for _, level in schedule]
    assert set(levels) <= {1, 4, 16, 32} and len(set(levels)) >= 3  # 64 capped to max_concurrency
    assert all(a != b for a, b in zip(levels, levels[1:]))
    assert concurrency_at(schedule, 0.0) == levels[0] and concurrency_at(schedule, 7.5) == levels[2]
    assert concurrency_at(schedule, 1e9) == levels[-1]


@pytest.mark.parametrize("change,name", [
    ({"seconds": 0}, "seconds"), ({"max_context": 100}, "max_context"), ({"max_output": 2048}, "max_output"),
    ({"kv_tokens": 2048}, "kv_tokens"), ({"chunk_tokens": 8}, "chunk_tokens"), ({"max_concurrency": 0},
                                                                                 "max_concurrency"),
    ({"concurrency_levels": ()}, "concurrency_levels"), ({"phase_s": -1}, "phase_s"),
    ({"prefix_share": 1.5}, "prefix_share"), ({"abort_share": -0.1}, "abort_share")])
def test_impossible_loads_are_refused_with_the_setting_named(change, name):
    with pytest.raises(ValueError, match=rf"{name}=.* is not supported; "):
        check_load(dataclasses.replace(LOAD_, **change))
    check_load(LOAD_)
    assert LOAD_.pool_tokens == 3 * 2048 and dataclasses.replace(LOAD_, kv_tokens=2200).pool_tokens == 2240


# ----------------------------------------------------------------------------- bookkeeping
def test_a_slow_engine_start_shortens_the_sending_not_the_drain():
    load = dataclasses.replace(LOAD_, seconds=60, drain_s=30)
    assert sending_window(load, time.time() + 1000) == 60
    assert 39 < sending_window(load, time.time() + 70) <= 40  # 70 s left: 40 of sending, then the drain
    assert sending_window(load, time.time() + 10) == 0
    # A baseline load still to come (start 40 s, drain 30 s) sends as long: 200 s left gives 50 s each.
    assert 49 < sending_window(load, time.time() + 200, later_loads=1, later_start_s=40) <= 50
    ledger = LoadLedger(load, VOCAB, start_s=100.0, send_s=40)
    assert ledger.sending(139.9) and not ledger.sending(140.0) and ledger.due(140.0) == []


def test_ledger_fills_to_the_schedule_aborts_when_due_and_accounts_every_request():
    load = dataclasses.replace(LOAD_, seconds=10, phase_s=5, concurrency_levels=(2, 5), max_concurrency=8)
    ledger = LoadLedger(load, VOCAB, start_s=100.0)
    first = concurrency_at(ledger.schedule, 0)
    plans = ledger.due(100.0)
    assert len(plans) == first == len(ledger.in_flight) and ledger.due(100.1) == []
    # a scripted engine: every request gets one token per step with a finite logprob
    for _ in range(load.max_output + 1):
        for key, state in list(ledger.in_flight.items()):
            ledger.add_tokens(key, [7], [-0.5])
            if len(state.tokens) == state.plan.max_tokens and not state.abort_sent:
                ledger.finish(key, "length")
        for key in ledger.aborts_due():
            ledger.finish(key, "abort")
    assert not ledger.in_flight
    outcomes = {r["index"]: r["outcome"] for r in ledger.records}
    for plan in plans:
        assert outcomes[plan.index] == (ABORTED if plan.abort_after else COMPLETED)
    second = concurrency_at(ledger.schedule, 6.0)
    assert len(ledger.due(106.0)) == second and ledger.due(111.0) == [] and not ledger.sending(111.0)
    key = next(iter(ledger.in_flight))
    ledger.finish(key, "abort")  # the engine aborted a request nobody asked it to
    ledger.add_tokens(next(iter(ledger.in_flight)), [1], [float("nan")])
    ledger.close("still running")
    records = {r["index"]: r for r in ledger.records}
    assert records[int(key[1:])]["outcome"] == FAILED and "'abort'" in records[int(key[1:])]["reason"]
    assert sum(r["outcome"] == UNFINISHED for r in records.values()) == second - 1
    assert sum(r["nonfinite_logprobs"] for r in records.values()) == 1
    assert ledger.peak_in_flight == max(first, second) and len(records) == ledger.next_index


def test_forced_selection_keeps_the_extremes_and_spreads_the_rest():
    records = [{"index": i, "outcome": COMPLETED if i % 3 else ABORTED, "prompt_len": 10 + (i * 37) % 500,
                "output": [1] * (1 + i % 5)} for i in range(300)]
    records[7]["prompt_len"] = 1
    records[200]["prompt_len"] = 4000
    chosen = forced_selection(records, 20)
    indices = [r["index"] for r in chosen]
    assert len(chosen) == 20 and indices == sorted(indices) and 7 in indices and 200 in indices
    assert all(r["outcome"] == COMPLETED for r in chosen) and indices[-1] > 250
    assert len(forced_selection(records, 1000)) == 200 and forced_selection(records, 0) == []


def test_forced_prompt_is_the_request_s_prompt_then_its_output():
    prefixes = shared_prefixes(LOAD_, VOCAB)
    sequence, prompt_len = forced_prompt(LOAD_, VOCAB, 5, [9, 8, 7], prefixes)
    assert sequence[:prompt_len] == plan_request(LOAD_, VOCAB, 5).prompt and sequence[prompt_len:] == [9, 8, 7]


# ----------------------------------------------------------------------------- verdict and report
def test_agreement_counts_positions_and_whole_requests():
    a = hostile_report.agreement({1: [1, 2, 3], 2: [4, 5], 3: [9]}, {1: [1, 2, 0], 2: [4, 5], 4: [1]})
    assert (a["requests"], a["steps"], a["agree"], a["requests_agreeing_everywhere"]) == (2, 5, 4, 1)
    assert a["fraction"] == 0.8 and a["first_disagreements"] == [{"request": 1, "step": 2}]
    assert hostile_report.agreement({}, {})["fraction"] is None


def _load_result(records, **errors):
    engine_errors = {"readable": True, "source": "test", "error_finishes": 0, "nan_logit_requests": 0, **errors}
    return {"status": "done", "records": records, "preemptions": 12, "prefix_cache": {"hit_tokens": 4096},
            "peak_in_flight": 64, "engine_errors": engine_errors, "engine_info": {"vllm": "0.26.0"}}


def _record(index, outcome, output, logprobs=None):
    return {"index": index, "outcome": outcome, "prompt_len": 5, "max_tokens": len(output), "abort_after": None,
            "prefix_group": None, "output": output, "logprobs_seen": len(output) if logprobs is None else logprobs,
            "nonfinite_logprobs": 0}


def test_summary_passes_a_clean_run_and_names_what_failed():
    records = [_record(0, COMPLETED, [1, 2, 3, 4]), _record(1, COMPLETED, [5, 6]), _record(2, ABORTED, [1])]
    baseline = _load_result([_record(0, COMPLETED, [1, 2, 3, 4]), _record(1, COMPLETED, [5, 7])])
    reference = ("FLASHMLA", {"status": "done", "argmax": {"ours": {"0": [1, 2, 3, 4], "1": [5, 0]},
                                                           "baseline": {"0": [1, 2, 3, 4], "1": [5, 7]}}})
    summary = hostile_report.summarize(_load_result(records), reference, ("FLASH_ATTN_MLA", baseline), margin=0.2)
    assert summary["passed"], summary["checks"]
    assert summary["counts"] == {"sent": 3, COMPLETED: 2, ABORTED: 1, FAILED: 0, UNFINISHED: 0}
    assert summary["baseline"]["counts"] == {"sent": 2, COMPLETED: 2, ABORTED: 0, FAILED: 0, UNFINISHED: 0}
    assert summary["agreement"]["ours_vs_FLASHMLA"]["fraction"] == pytest.approx(5 / 6, abs=1e-4)
    assert summary["agreement"]["FLASH_ATTN_MLA_vs_FLASHMLA"]["fraction"] == 1.0
    # Half of every request's steps against all of them: no spread between requests, so the margin (0.02) rules.
    halves = [_record(0, COMPLETED, [1, 0]), _record(1, COMPLETED, [5, 0])]
    strict = hostile_report.summarize(_load_result(halves), ("FLASHMLA", {"status": "done", "argmax": {
        "ours": {"0": [1, 2], "1": [5, 6]}, "baseline": {"0": [1, 2, 3, 4], "1": [5, 7]}}}), ("X", baseline))
    assert strict["checks"]["teacher_forced_agreement"]["ok"] is False
    assert "ours 0.5, built-in under the same load 1.0, allowed 0.02 less" in strict["checks"][
        "teacher_forced_agreement"]["detail"]
    # A reference or baseline that did not finish fails the comparison, whatever the shares.
    unfinished = hostile_report.summarize(_load_result(records), reference,
                                          ("FLASH_ATTN_MLA", {**baseline, "status": "failed"}), margin=0.2)
    assert not unfinished["checks"]["teacher_forced_agreement"]["ok"]
    resent = records + [_record(5, COMPLETED, [1, 2], logprobs=40)]  # SGLang re-sends some after a retraction
    assert hostile_report.summarize(_load_result(resent))["checks"]["finite_logprobs"]["ok"]
    bad = records + [_record(3, FAILED, [1]), _record(4, COMPLETED, [1, 2], logprobs=1)]
    summary = hostile_report.summarize(_load_result(bad, error_finishes=1), reference)
    assert not summary["passed"]
    assert {k for k, c in summary["checks"].items() if not c["ok"]} == {
        "every_request_accounted", "finite_logprobs", "engine_error_counters_zero"}
    unreadable = _load_result(records)
    unreadable["engine_errors"]["readable"] = False
    assert not hostile_report.summarize(unreadable)["checks"]["engine_error_counters_zero"]["ok"]


def test_agreement_standard_error_treats_requests_as_clusters():
    a = hostile_report.agreement({1: [1, 2], 2: [3, 4]}, {1: [1, 2], 2: [0, 0]})
    assert a["fraction"] == 0.5 and a["standard_error"] == 0.5
    assert hostile_report.agreement({1: [1, 2]}, {1: [1, 2]})["standard_error"] is None  # one request: unknown


def test_forced_sequences_alternate_between_the_loads():
    ours = [{"index": i, "output": [i]} for i in range(3)]
    sequences = hostile.interleave({"ours": ours, "baseline": ours[:1]})
    assert [(s["source"], s["index"]) for s in sequences] == [("ours", 0), ("baseline", 0), ("ours", 1), ("ours", 2)]


def test_report_writes_json_and_a_markdown_table(tmp_path):
    records = [_record(0, COMPLETED, [1, 2])]
    reference = ("flashmla", {"status": "done", "argmax": {"ours": {"0": [1, 2]}, "baseline": {"0": [1, 2]}}})
    report = {"engine": "sglang", "engine_version": "0.5.17", "ours": "tilelang_mla", "load": load_to_dict(LOAD_),
              "backends": ["tilelang_mla", "flashmla", "triton"],
              "summary": hostile_report.summarize({**_load_result(records), "sent_s": 40.0}, reference,
                                                  ("triton", _load_result(records))), "records": records}
    files = hostile_report.write_outputs(tmp_path, report)
    text = (tmp_path / "hostile.md").read_text()
    assert len(files) == 2 and "| tilelang_mla (ours) | 40.0 s | 1 | 1 | 0 | 0 | 0 | 12 | 4096 | 64 |" in text
    assert "| triton (baseline) | - s | 1 | 1 |" in text and "Passed: yes" in text
    assert "| ours vs flashmla | 1 | 2 | 1.0 | - | 1 |" in text and "| triton vs flashmla |" in text
    assert "tilelang_mla + MTP" in text


# ----------------------------------------------------------------------------- engine output parsing
def test_sglang_stream_merge_and_input_top_logprobs():
    from mla_backend.serve_bench.hostile_sglang import finish_type, log_counts, merge, top1_tokens

    assert merge([1, 2], [1, 2, 3], 3) == [1, 2, 3]  # cumulative (SGLang's default)
    assert merge([1, 2], [3, 4], 4) == [1, 2, 3, 4]  # incremental
    top = [None, [(-0.1, 11, None)], [[-0.2, 12, None]], [(-0.3, 13, None)]]
    assert top1_tokens(top, 2) == [11, 12]
    assert finish_type({"type": "length", "length": 4}) == "length" and finish_type(None) is None
    log = ("KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 9\n"
           "x #retracted_reqs: 2\nTraceback (most recent call last):\n")
    assert log_counts(log) == {"retracted": 5, "tracebacks": 1}


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")
def test_vllm_rank1_prompt_logprobs_and_counters():
    from vllm.logprobs import Logprob

    from mla_backend.serve_bench.hostile_vllm import counter_deltas, engine_report, rank1_tokens, sampled_logprobs

    positions = [None, {5: Logprob(-0.1, rank=1)}, {7: Logprob(-2.0, rank=3), 8: Logprob(-0.2, rank=1)}]
    assert rank1_tokens(positions, 1, 3) == [5, 8]

    class Completion:
        token_ids = [8, 5]
        logprobs = [{8: Logprob(-0.2, rank=1)}, {5: Logprob(float("nan"), rank=1)}]

    assert sampled_logprobs(Completion())[0] == -0.2 and math.isnan(sampled_logprobs(Completion())[1])
    deltas = counter_deltas({"vllm:num_preemptions": 2}, {"vllm:num_preemptions": 9,
                                                          "vllm:request_success{abort}": 4})
    report = engine_report(deltas, aborts_sent=4, readable=True)
    assert report["preemptions"] == 7 and report["engine_errors"]["unrequested_aborts"] == 0


# ----------------------------------------------------------------------------- command line
def test_serve_bench_hands_the_hostile_workload_to_its_driver(capsys):
    assert hostile.selected(["--engine", "vllm", "--workloads", "decode,hostile"])
    assert hostile.selected(["--workloads=hostile"]) and not hostile.selected(["--workloads", "decode"])
    assert cli.main(["serve-bench", "--engine", "sglang", "--workloads", "hostile", "--duration", "60",
                     "--budget", "800", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "under load tilelang_mla (ours), then triton (baseline); forcing both: flashmla (reference)" in out
    assert "KV pool 24576 tokens" in out
    # Two loads share what the budget leaves: after a 300 s start (and the baseline's planned 150 s), 45 s each.
    assert "sending for up to 60 s; 45 s if the load engine takes the 300 s" in out
    # Without --duration each load sends as long as the budget allows after the starts; a cold start leaves 20 s.
    assert cli.main(["serve-bench", "--engine", "vllm", "--workloads", "hostile", "--budget", "530", "--dry-run"]) == 0
    assert "sending for up to 110 s; 20 s if the load engine takes the 180 s" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--workloads", "hostile,decode"], "hostile runs alone"),
    (["--workloads", "hostile", "--duration", "300", "--budget", "200"], "give --budget >= 350 plus that start"),
    (["--workloads", "hostile", "--duration", "0"], "--duration 0.0: give a positive number"),
    (["--workloads", "hostile", "--backends", "a,b,c,d"], "1 to 3 backends"),
    (["--workloads", "hostile", "--kv-tokens", "1000"], "kv_tokens=1000 is not supported"),
    (["--workloads", "hostile", "--heads", "300"], "heads")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        hostile.main(["--engine", "vllm", "--dry-run"] + argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit status where there is no GPU")
def test_no_gpu_exits_with_status_2(capsys):
    assert hostile.main(["--engine", "vllm", "--workloads", "hostile", "--duration", "10"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the engines' own argument checks
def _spec(tmp_path, engine: str, mode: str, backend: str, kv: str = "auto", mtp: bool = True) -> HostileSpec:
    model_dir = write_model_dir(tmp_path / "model", heads=16, layers=4)
    load = dataclasses.replace(LOAD_, mtp=mtp, max_context=4096, kv_tokens=10000)
    return HostileSpec(mode=mode, engine=engine, backend=backend, model_dir=str(model_dir), vocab_size=VOCAB,
                       load=load_to_dict(load), result_path=str(tmp_path / "r.json"), log_path=str(tmp_path / "l"),
                       kv_cache_dtype=kv)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")
@pytest.mark.parametrize("mtp", [True, False])
def test_vllm_engine_args_accept_the_hostile_arguments(tmp_path, mtp):
    from vllm.config import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from mla_backend.serve_bench.hostile_vllm import forced_engine_kwargs, load_engine_kwargs
    for backend in hostile.ENGINES["vllm"]["backends"]:
        assert AttentionBackendEnum[backend].name == backend
    args = EngineArgs(**load_engine_kwargs(_spec(tmp_path, "vllm", LOAD, "CUSTOM", mtp=mtp)))
    assert args.enable_prefix_caching is True and args.enable_chunked_prefill is True
    assert args.num_gpu_blocks_override == 10048 // 64 and args.max_num_batched_tokens == LOAD_.chunk_tokens
    assert args.max_model_len == 4096 and args.block_size == 64 and args.disable_log_stats is False
    if mtp:
        fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        assert set(args.speculative_config) <= fields and args.speculative_config["num_speculative_tokens"] == 1
    else:
        assert args.speculative_config is None
    model = args.create_model_config()
    assert model.use_mla and model.max_model_len == 4096
    forced = EngineArgs(**forced_engine_kwargs(_spec(tmp_path, "vllm", FORCED, "FLASHMLA")))
    assert forced.enforce_eager and forced.enable_prefix_caching is False and forced.speculative_config is None
    assert forced.create_model_config().max_model_len == 4096 + PAGE_TOKENS


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not importable (CI: PYTHONPATH=.ci/sglang-site)")
@pytest.mark.parametrize("mtp", [True, False])
def test_sglang_server_args_accept_the_hostile_arguments(tmp_path, mtp):
    import argparse

    from sglang_cpu_env import prepare_cpu_torchvision

    prepare_cpu_torchvision()
    from sglang.srt.server_args import ServerArgs

    from mla_backend.serve_bench.hostile_sglang import forced_server_kwargs, load_server_kwargs
    from mla_backend.sglang_plugin import register

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = {a.dest: a.choices for a in parser._actions if a.choices}
    dests = {a.dest for a in parser._actions}
    for backend in hostile.ENGINES["sglang"]["backends"]:
        assert backend in choices["attention_backend"]
    load_kwargs = load_server_kwargs(_spec(tmp_path, "sglang", LOAD, "tilelang_mla", mtp=mtp))
    forced_kwargs = forced_server_kwargs(_spec(tmp_path, "sglang", FORCED, "flashmla"))
    for kwargs in (load_kwargs, forced_kwargs):
        for key, value in kwargs.items():
            assert key in dests, key
            assert key not in choices or value in choices[key], (key, value, choices[key])
        ServerArgs(**kwargs)  # the dataclass takes every name
    assert load_kwargs["disable_radix_cache"] is False and load_kwargs["max_total_tokens"] == 10048
    assert load_kwargs["chunked_prefill_size"] == LOAD_.chunk_tokens and load_kwargs["enable_metrics"]
    assert ("speculative_algorithm" in load_kwargs) == mtp
    assert forced_kwargs["disable_cuda_graph"] and forced_kwargs["context_length"] == 4096 + PAGE_TOKENS
