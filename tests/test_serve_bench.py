"""CPU tests of ``mla-backend serve-bench`` (mla_backend/serve_bench): everything short of running an engine.

* the generated model config (DeepSeek-V3's attention fields, heads and layers, parameter counts);
* workload construction, token prompts and the KV-cache sizing;
* timing from token arrivals (staggered prefill, coalesced samples), the mixed-load window and the summaries;
* the reason an engine gives for refusing a backend (the profiler-trace reader: test_serve_bench_traces.py);
* the report (markdown tables, JSON, plot) from a synthetic run;
* the engine-process loop with stand-in sessions written here (the driver's orchestration:
  test_serve_bench_driver.py);
* exit status 2 without a GPU, through ``mla-backend serve-bench``;
* the vLLM runner's engine arguments accepted by vLLM's own ``EngineArgs`` (which also reads the generated config),
  and the SGLang runner's by SGLang's own ``ServerArgs`` (with ``PYTHONPATH=.ci/sglang-site``; skipped without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mla_backend import cli
from mla_backend.serve_bench import driver, report, sglang_runner, verification, vllm_runner
from mla_backend.serve_bench.measure import (TokenTracker, decode_window_tpots, full_batch_start, request_tpots,
                                             summarize, tpot_between)
from mla_backend.serve_bench.model_config import (DEEPSEEK_V3_ATTENTION, deepseek_v3_config, kv_bytes_per_token,
                                                  parameter_counts, shared_config_dir, write_model_dir)
from mla_backend.serve_bench.runner_common import (EngineSession, EngineSpec, decode_record, kv_capacity_problem,
                                                   measurement, mixed_repeat, refusal_reason, run_engine_process)
from mla_backend.serve_bench.workloads import (DecodeCell, MeasurePlan, MixedLoad, ThroughputLoad, build_workloads,
                                               decode_max_tokens, kv_tokens_needed, longest_request, token_prompts,
                                               workload_from_dict, workload_to_dict)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ----------------------------------------------------------------------------- model config
def test_config_has_deepseek_v3_attention_with_the_heads_and_layers_asked_for(tmp_path):
    for heads in (16, 32, 128):
        path = write_model_dir(tmp_path / f"h{heads}", heads=heads, layers=5)
        config = json.loads((path / "config.json").read_text())
        assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
        assert config["num_attention_heads"] == config["num_key_value_heads"] == heads
        assert config["num_hidden_layers"] == 5
        assert all(config[key] == value for key, value in DEEPSEEK_V3_ATTENTION.items())
        assert (config["hidden_size"], config["q_lora_rank"], config["kv_lora_rank"]) == (7168, 1536, 512)
        assert (config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]) == (128, 64, 128)
        assert config["rope_scaling"] == {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        assert config["max_position_embeddings"] == 163840 and config["torch_dtype"] == "bfloat16"
        assert "quantization_config" not in config  # bf16 weights
        # a small MoE in DeepSeek's grouped routing
        assert config["n_routed_experts"] % config["n_group"] == 0 and config["topk_group"] <= config["n_group"]
        assert config["num_experts_per_tok"] < config["n_routed_experts"] <= 16
        assert config["first_k_dense_replace"] < config["num_hidden_layers"]


def test_config_rejects_impossible_shapes_and_takes_overrides():
    with pytest.raises(ValueError, match="heads"):
        deepseek_v3_config(heads=256)
    with pytest.raises(ValueError, match="layers"):
        deepseek_v3_config(layers=0)
    assert deepseek_v3_config(n_routed_experts=32)["n_routed_experts"] == 32


def test_one_model_directory_per_config_whatever_the_out_dir(tmp_path, monkeypatch):
    """vLLM keys its compile cache by the model's path: runs of one config share a path, other configs do not."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config, other = deepseek_v3_config(16, 4), deepseek_v3_config(16, 5)
    first = shared_config_dir(config, fallback=tmp_path / "run1" / "model")
    again = shared_config_dir(json.loads(json.dumps(config)), fallback=tmp_path / "run2" / "model")
    assert first == again and first.parent == tmp_path / "cache" / "mla_backend" / "models"
    assert json.loads((first / "config.json").read_text()) == config
    assert shared_config_dir(other, fallback=tmp_path / "run3" / "model") != first
    assert not (tmp_path / "run1").exists() and [p.name for p in first.iterdir()] == ["config.json"]
    (first / "config.json").write_text("{}")  # a damaged file is written again, not trusted
    assert json.loads((shared_config_dir(config, fallback=tmp_path / "x") / "config.json").read_text()) == config
    # an unwritable cache: the run's own directory, as before
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a directory")
    assert shared_config_dir(config, fallback=tmp_path / "run4" / "model") == tmp_path / "run4" / "model"
    assert json.loads((tmp_path / "run4" / "model" / "config.json").read_text()) == config


def test_parameter_counts_reproduce_deepseek_v3_at_full_size():
    full = deepseek_v3_config(128, 61, vocab_size=129280, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                              topk_group=4, moe_intermediate_size=2048, intermediate_size=18432,
                              first_k_dense_replace=3)
    assert sum(parameter_counts(full).values()) / 1e9 == pytest.approx(671.0, abs=0.5)  # the published 671B
    small = parameter_counts(deepseek_v3_config(16, 8))
    assert sum(small.values()) * 2 < 8 * 2**30  # bf16 weights leave most of one GPU to the KV cache
    assert kv_bytes_per_token(deepseek_v3_config(16, 8)) == 8 * 576 * 2
    assert kv_bytes_per_token(deepseek_v3_config(16, 8), "fp8_e4m3") == 8 * 576


# ----------------------------------------------------------------------------- workloads
def test_default_workloads_cover_the_grid_in_order():
    workloads = build_workloads()
    cells = [w for w in workloads if isinstance(w, DecodeCell)]
    assert [(c.batch, c.context) for c in cells] == [(b, c) for b in (1, 16, 64, 256) for c in (1024, 8192, 32768)]
    assert isinstance(workloads[-2], ThroughputLoad) and isinstance(workloads[-1], MixedLoad)
    assert (workloads[-2].prompts, workloads[-2].input_len, workloads[-2].output_len) == (256, 128, 512)
    assert cells[0].name == "decode b1 1k" and len({w.name for w in workloads}) == len(workloads)
    assert build_workloads(("mixed",)) == [MixedLoad()]
    with pytest.raises(ValueError, match="unknown workload"):
        build_workloads(("decode", "prefill"))


def test_workloads_round_trip_through_json():
    for w in build_workloads(batches=(4,), contexts=(2048,)):
        assert workload_from_dict(json.loads(json.dumps(workload_to_dict(w)))) == w


def test_token_prompts_are_seeded_and_in_range():
    a = token_prompts(3, 50, 100, seed=7)
    assert a == token_prompts(3, 50, 100, seed=7) and a != token_prompts(3, 50, 100, seed=8)
    assert [len(p) for p in a] == [50, 50, 50] and all(2 <= t < 100 for p in a for t in p)


def test_decode_requests_last_through_staggered_prefill_and_every_timed_step():
    plan = MeasurePlan()
    cell = DecodeCell(256, 8192)
    # the first request can decode during every prefill step of the others before the batch is full
    assert decode_max_tokens(cell, plan, 8192) >= 256 * 8192 // 8192 + plan.decode_steps()
    assert decode_max_tokens(cell, plan, 2048) > decode_max_tokens(cell, plan, 8192)
    assert kv_tokens_needed(cell, plan, 8192) == 256 * (8192 + decode_max_tokens(cell, plan, 8192))
    assert longest_request(cell, plan) == 8192 + decode_max_tokens(cell, plan)
    mixed = MixedLoad()
    assert kv_tokens_needed(mixed, plan) > mixed.long_prompts * mixed.long_context


def test_driver_resolves_the_command_line():
    args = driver.build_parser().parse_args(["--engine", "sglang", "--backends", "TileLang_MLA,FA3",
                                             "--contexts", "1k,3000", "--batches", "2", "--kv-cache-dtype", "fp8"])
    run = driver.resolve(args)
    assert run.backends == ("tilelang_mla", "fa3") and run.kv_cache_dtype == "fp8_e4m3"
    assert [w.name for w in run.workloads][:2] == ["decode b2 1k", "decode b2 3000"]
    assert run.max_model_len % 1024 == 0 and run.max_model_len >= max(longest_request(w, run.plan)
                                                                        for w in run.workloads)
    assert run.max_num_seqs == 256  # the throughput load's prompts
    vllm_run = driver.resolve(driver.build_parser().parse_args(["--engine", "vllm"]))
    assert vllm_run.backends[0] == "CUSTOM" and vllm_run.kv_cache_dtype == "auto"
    with pytest.raises(ValueError):
        driver.resolve(driver.build_parser().parse_args(["--engine", "vllm", "--repeats", "0"]))


@pytest.mark.parametrize("engine,kv_cache_dtype,given,expected", [
    ("sglang", "fp8", None, 0.6),  # room beside the pool for SGLang's bf16 copy of a layer's fp8 pool in prefill
    ("sglang", "auto", None, 0.85),
    ("vllm", "fp8", None, 0.85),
    ("sglang", "fp8", "0.9", 0.9),  # what the command line names wins
])
def test_the_gpu_memory_fraction_leaves_room_for_sglang_s_fp8_prefill(engine, kv_cache_dtype, given, expected):
    argv = ["--engine", engine, "--kv-cache-dtype", kv_cache_dtype, "--gpu-memory-gib", "80"]
    run = driver.resolve(driver.build_parser().parse_args(argv + (["--gpu-memory-fraction", given] if given else [])))
    assert run.args.gpu_memory_fraction == expected
    assert any(f"of {80 * expected:.1f} GiB the engine may use" in line for line in driver.describe_run(run))


# ----------------------------------------------------------------------------- timing
def _staggered_batch(tracker, batch=4, step_s=0.010, steps=60, coalesce_every=0):
    """Request r gets its first token at step r (staggered prefill), then one token per step; with
    ``coalesce_every`` k, only every k-th step is observed (several tokens arrive together)."""
    for step in range(steps):
        if coalesce_every and step % coalesce_every:
            continue
        for r in range(batch):
            if step >= r:
                tracker.record(f"r{r}", 1.0 + step * step_s, step - r + 1)


@pytest.mark.parametrize("coalesce_every", [0, 3])
def test_decode_windows_time_full_batch_steps(coalesce_every):
    tracker = TokenTracker()
    _staggered_batch(tracker, coalesce_every=coalesce_every)
    keys = [f"r{r}" for r in range(4)]
    # the batch is full from the last request's first token on (step 3)
    last_first = full_batch_start(tracker.subset(keys))
    assert tracker.all_started(keys) and last_first == pytest.approx(1.030)
    base = {k: tracker.requests[k].tokens_at(last_first) for k in keys}
    assert base == ({"r0": 4, "r1": 3, "r2": 2, "r3": 1})
    tpots = decode_window_tpots(tracker.subset(keys), base, warmup_steps=2, window_steps=12, windows=3)
    assert len(tpots) == 3 and tpots == pytest.approx([0.010] * 3)
    assert decode_window_tpots(tracker.subset(keys), base, 2, 12, windows=10)  # windows past the data are left out
    assert len(decode_window_tpots(tracker.subset(keys), base, 2, 12, windows=10)) < 10


def test_interference_window_and_request_tpots():
    tracker = TokenTracker()
    _staggered_batch(tracker, batch=2, step_s=0.02, steps=21)
    tpot, tokens = tpot_between(tracker.requests, 1.1, 1.3)
    assert tpot == pytest.approx(0.02) and tokens == 2 * 10
    assert request_tpots(tracker.requests) == pytest.approx([0.02, 0.02])
    assert tracker.min_progress({"r0": 5, "r1": 5}) == min(21 - 5, 20 - 5)


def test_mixed_repeat_measures_from_the_first_arrival_to_the_last_first_token():
    tracker = TokenTracker()
    for step in range(50):  # two decoders, one token per 10 ms step
        for r in range(2):
            tracker.record(f"d{r}", step * 0.01, step + 1)
    tracker.submit("long0", 0.100)
    tracker.record("long0", 0.250, 1)
    tracker.submit("long1", 0.200)
    tracker.record("long1", 0.400, 1, engine_ttft=0.150)  # the engine's own figure wins
    stats = mixed_repeat(tracker, ["d0", "d1"], ["long0", "long1"], window_start=0.100)
    assert stats["window_s"] == pytest.approx(0.300)
    assert stats["tpot_ms"] == pytest.approx(10.0)
    assert stats["ttft_ms"] == pytest.approx(150.0)  # median of 150 and 150
    assert stats["output_tok_per_s"] == pytest.approx((2 * 30 + 2) / 0.300)
    sampled = mixed_repeat(tracker, ["d0"], ["long0", "long1"], 0.100, decoder_count=2)  # a streamed sample of 2
    assert sampled["output_tok_per_s"] == pytest.approx(stats["output_tok_per_s"])


def test_summaries_give_median_and_spread_of_the_repeats():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([4.0, None, 2.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert summarize([]) is None and summarize([None]) is None
    record = measurement(DecodeCell(1, 1024), [{"tpot_ms": 2.0, "output_tok_per_s": 500.0},
                                               {"tpot_ms": 4.0, "output_tok_per_s": 250.0},
                                               {"tpot_ms": 3.0, "output_tok_per_s": 333.0}])
    assert record["status"] == "ok" and len(record["repeats"]) == 3
    assert record["tpot_ms"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}
    assert record["output_tok_per_s"]["median"] == 333.0
    assert measurement(DecodeCell(1, 1024), [])["status"] == "no data"


def test_decode_record_converts_windows_to_tpot_and_rate():
    tracker = TokenTracker()
    _staggered_batch(tracker, batch=4, step_s=0.005)
    keys = [f"r{r}" for r in range(4)]
    base = {k: tracker.requests[k].tokens_at(full_batch_start(tracker.subset(keys))) for k in keys}
    plan = MeasurePlan(repeats=3, warmup_steps=2, window_steps=10, profile_steps=0)
    record = decode_record(DecodeCell(4, 1024), plan, tracker.subset(keys), base, None, prefill_s=0.5)
    assert record["tpot_ms"]["median"] == pytest.approx(5.0) and record["tpot_ms"]["n"] == 3
    assert record["output_tok_per_s"]["median"] == pytest.approx(4 / 0.005)


# ----------------------------------------------------------------------------- refusals
def test_refusal_reason_prefers_the_engine_s_own_words():
    selection = ("ValueError: Selected backend FLASH_ATTN_MLA is not valid for this configuration. Reason: "
                 "['kv_cache_dtype not supported']")
    log = f"INFO starting\nTraceback (most recent call last):\n  File x\n{selection}\n"
    generic = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert refusal_reason(generic, log).startswith("Selected backend FLASH_ATTN_MLA is not valid")
    assert "kv_cache_dtype not supported" in refusal_reason(generic, log)
    crash = "Traceback\n  File y\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    assert refusal_reason(generic, crash) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert refusal_reason(ValueError("tilelang_mla: 256 query heads per rank"), "") == \
        "ValueError: tilelang_mla: 256 query heads per rank"


def test_kv_capacity_problem_names_what_does_not_fit():
    plan = MeasurePlan()
    assert kv_capacity_problem(DecodeCell(256, 32768), plan, 2_000_000, 8192).startswith("needs ")
    assert kv_capacity_problem(DecodeCell(1, 1024), plan, 2_000_000, 8192) is None
    assert kv_capacity_problem(DecodeCell(256, 32768), plan, None, 8192) is None  # capacity unknown: try it


# ----------------------------------------------------------------------------- report
def _decode_record(name, tpots, share=None, kind="decode", kernel_us=None):
    record = measurement(DecodeCell(16, 8192), [{"tpot_ms": t, "output_tok_per_s": 16e3 / t} for t in tpots])
    record["workload"], record["kind"] = name, kind
    if share is not None:
        record["profile"] = {"attention_share": share, "attention_us_per_step": 1234.0,
                             **({"kernel_us_per_step": kernel_us} if kernel_us else {})}
    return record


REPORT_ENV = {"date": "2026-12-01T10:00:00+00:00", "command": "mla-backend serve-bench --engine vllm", "gpu": "H100",
              "driver": "570.1", "torch": "2.11.0", "vllm": "0.26.0", "tilelang": "0.1.9", "git": "abc"}


def _synthetic_report():
    run = driver.resolve(driver.build_parser().parse_args(
        ["--engine", "vllm", "--backends", "CUSTOM,FLASHMLA,FLASH_ATTN_MLA,TRITON_MLA", "--batches", "16",
         "--contexts", "8k", "--workloads", "decode,throughput"]))
    tput = measurement(ThroughputLoad(), [{"output_tok_per_s": v} for v in (9000.0, 9100.0, 8900.0)])
    backends = {
        "CUSTOM": {"status": "done", "engine_info": {"start_s": 80.0, "kv_capacity_tokens": 7_000_000,
                                                    "prefill_chunk_tokens": 16384, "vllm": "0.26.0"},
                   "workloads": [_decode_record("decode b16 8k", [4.0, 4.1, 3.9], 0.41), tput]},
        "FLASHMLA": {"status": "done", "engine_info": {"start_s": 75.0},
                     "workloads": [_decode_record("decode b16 8k", [5.0, 5.2, 4.9], 0.48),
                                   measurement(ThroughputLoad(), [{"output_tok_per_s": 8000.0}] * 3)]},
        "FLASH_ATTN_MLA": {"status": "refused", "reason": "Selected backend FLASH_ATTN_MLA is not valid",
                           "workloads": []},
        "TRITON_MLA": {"status": "skipped", "reason": "time budget: run it alone: mla-backend serve-bench ...",
                       "workloads": []},
    }
    return report.assemble(dict(REPORT_ENV), run, backends, wall_s=321.0)


def test_markdown_tables_show_median_spread_and_the_speedup_of_ours():
    text = report.markdown(_synthetic_report())
    assert "### serve-bench: vllm 0.26.0 on H100 (2026-12-01)" in text
    assert "| workload | CUSTOM | FLASHMLA | FLASH_ATTN_MLA | TRITON_MLA | ours vs best built-in |" in text
    assert "| decode b16 8k | 4.00 [3.90-4.10] | 5.00 [4.90-5.20] | – | – | 1.25 (FLASHMLA) |" in text
    assert "| throughput 256x128/512 | 9000 [8900-9100] | 8000 [8000-8000] | – | – | 1.12 (FLASHMLA) |" in text
    assert "| decode b16 8k | 41% (1234 µs) | 48% (1234 µs) | – | – |" in text
    assert "| FLASH_ATTN_MLA | refused |" in text and "Selected backend FLASH_ATTN_MLA is not valid" in text
    assert "| TRITON_MLA | skipped |" in text and "run it alone" in text
    assert "Command: `mla-backend serve-bench --engine vllm`" in text and "16 heads, 8 layers" in text
    assert "Host time per call" not in text  # no profile held host ranges
    data = _synthetic_report()
    data["backends"]["CUSTOM"]["workloads"][0]["profile"]["communication_us_per_step"] = 537.0
    assert "| decode b16 8k | 41% (1234 µs; communication 537 µs) | 48% (1234 µs) | – | – |" in report.markdown(data)
    # the MTP drafter's backend is noted where it is not the backend under test (None: vLLM chose it)
    data["backends"]["CUSTOM"]["engine_info"]["draft_attention_backend"] = "CUSTOM"
    data["backends"]["FLASHMLA"]["engine_info"]["draft_attention_backend"] = None
    text = report.markdown(data)
    assert "its MTP layer's attention ran on a backend vLLM chose" in text
    assert text.count("its MTP layer's attention ran on") == 1


def test_pace_table_says_whether_the_gpu_or_the_host_set_each_decode_cell_s_tpot():
    data = _synthetic_report()
    assert "What paced each decode cell" not in report.markdown(data)  # no GPU kernel time profiled: no table
    custom, flashmla = (data["backends"][b]["workloads"][0] for b in ("CUSTOM", "FLASHMLA"))
    custom["profile"]["kernel_us_per_step"] = 3900.0  # TPOT 4.00 ms: within 5% of the step's GPU time
    flashmla["profile"]["kernel_us_per_step"] = 4100.0  # TPOT 5.00 ms: 22% above it
    text = report.markdown(data)
    assert "| decode b16 8k | 3.90 / 4.00 (GPU) | 4.10 / 5.00 (host) | – | – | 1.05 (FLASHMLA) |" in text
    assert report.paced_by(4.4, 4.1) == "host" and report.paced_by(4.3, 4.1) == "GPU"  # the bound: 4.305 ms
    data["settings"]["speculative_tokens"] = 1  # a step yields 1 + accepted tokens: TPOT is not its time
    assert "What paced each decode cell" not in report.markdown(data)


def test_verification_passes_only_when_every_rank_checked_calls_within_the_limits():
    data = _synthetic_report()
    assert verification.verdict(data) is None and verification.markdown(data) == []  # the run did not verify
    data["settings"]["verify"] = True
    rank = {"calls": 120, "max_rel_err": 3.1e-3, "max_lse_err": 2e-4, "calls_by_q_len": {"1": 120}}
    data["backends"]["CUSTOM"]["verification"] = [dict(rank, rank=0), dict(rank, rank=1)]
    checked = verification.verdict(data)
    assert checked["passed"] is True and len(checked["ranks"]) == 2
    text = report.markdown(data)
    assert "| 1 | 120 (1: 120) | 3.10e-03 | 2.00e-04 |" in text and "**PASS**" in text
    assert "Every engine eager" in text  # its speeds are eager ones
    for broken in (dict(rank, rank=1, max_rel_err=0.2), dict(rank, rank=1, max_lse_err=float("nan")),
                   dict(rank, rank=1, calls=0)):
        data["backends"]["CUSTOM"]["verification"] = [dict(rank, rank=0), broken]
        checked = verification.verdict(data)
        assert checked["passed"] is False and checked["reason"] == "ranks [1] checked no call or were past the limits"
        assert "**FAIL**" in report.markdown(data)
    data["backends"]["CUSTOM"]["verification"] = []
    assert "did not reach it" in verification.verdict(data)["reason"]
    data["backends"]["CUSTOM"]["status"] = "failed"  # no verdict on an engine that did not finish
    assert verification.verdict(data) is None


def test_markdown_host_table_per_range_and_backend():
    data = _synthetic_report()
    data["backends"]["CUSTOM"]["workloads"][0]["profile"]["host"] = {
        "mla_backend.vllm.build_decode": {"calls": 5, "p50_us": 21.04, "p99_us": 35.0, "max_us": 35.0}}
    text = report.markdown(data)
    assert "#### Host time per call in the profiled steps, µs p50 / p99 (calls)" in text
    assert "| decode b16 8k | `mla_backend.vllm.build_decode` | 21.0 / 35.0 (5) | – | – | – |" in text
    assert "`aten::slice`: a torch op the engine's own step code calls alike" in text


def test_markdown_host_children_table_lists_each_range_s_children():
    data = _synthetic_report()
    assert "Inside our host ranges" not in report.markdown(data)  # no trace read: no table
    data["backends"]["CUSTOM"]["workloads"][0]["profile"]["host_children"] = {
        "mla_backend.vllm.build_decode": {"calls": 5, "us_per_call": 120.0,
                                          "children": {"cudaLaunchKernelExC": 70.0, "aten::as_strided": 10.0,
                                                       "(self)": 40.0}}}
    text = report.markdown(data)
    assert "#### Inside our host ranges in the profiled steps, µs per call" in text
    assert ("| decode b16 8k | CUSTOM | `mla_backend.vllm.build_decode` | 120.0 (5) | `cudaLaunchKernelExC` 70.0, "
            "`aten::as_strided` 10.0, `(self)` 40.0 |") in text


def test_markdown_host_timer_table_shows_the_slowest_rank():
    data = _synthetic_report()
    ranges = lambda p50, p99: {"mla_backend.vllm.build_decode": {"calls": 100, "p50_us": p50, "p99_us": p99,  # noqa
                                                                 "max_us": p99}}
    data["backends"]["CUSTOM"]["workloads"][0]["host_timers"] = [{"rank": 0, "ranges": ranges(18.5, 40.0)},
                                                                  {"rank": 1, "ranges": ranges(21.0, 35.0)}]
    text = report.markdown(data)
    assert "#### Host time per call without a profiler, µs p50 / p99 (calls), slowest rank" in text
    assert "| decode b16 8k | `mla_backend.vllm.build_decode` | 21.0 / 40.0 (200) | – | – | – |" in text
    engine = data["settings"]["engine"]
    for name, ranges_text in report.HOST_TIMER_RANGES.items():  # the footer explains this engine's ranges only
        assert (ranges_text in text) == (name == engine), name


def test_outputs_hold_every_raw_repeat(tmp_path, capsys):
    data = _synthetic_report()
    files = report.write_outputs(tmp_path, data)
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    repeats = saved["backends"]["CUSTOM"]["workloads"][0]["repeats"]
    assert [r["tpot_ms"] for r in repeats] == [4.0, 4.1, 3.9]
    assert saved["settings"]["plan"]["repeats"] == 3 and saved["model"]["config"]["num_attention_heads"] == 16
    assert (tmp_path / "serve_bench.md").read_text() == report.markdown(data)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "serve_bench.png").stat().st_size > 0 and str(tmp_path / "serve_bench.png") in files
    else:
        assert "matplotlib is not installed" in capsys.readouterr().err and len(files) == 2
    assert report.anything_measured(data)
    assert report.format_summary(None, 1) == "–"


# ----------------------------------------------------------------------------- the engine-process loop
class StubSession(EngineSession):
    """A stand-in for an engine (no engine here): decode cells give a fixed TPOT, throughput fails."""

    kv_capacity_tokens = 1_000_000
    prefill_chunk_tokens = 8192

    def start(self):
        return {"kv_capacity_tokens": self.kv_capacity_tokens}

    def decode_cell(self, cell, plan):
        return measurement(cell, [{"tpot_ms": 1.0 + cell.batch / 100, "output_tok_per_s": 1.0}] * plan.repeats)

    def throughput(self, load, plan):
        raise RuntimeError("CUDA error: out of memory")


def _spec(tmp_path, workloads, **kw) -> EngineSpec:
    return EngineSpec(engine="vllm", backend="STUB", model_dir=str(tmp_path), vocab_size=1000,
                      result_path=str(tmp_path / "result.json"), log_path=str(tmp_path / "engine.log"),
                      profile_dir=str(tmp_path), workloads=[workload_to_dict(w) for w in workloads],
                      plan={"repeats": 3}, **kw)


def test_engine_process_loop_records_every_workload_and_keeps_going(tmp_path):
    workloads = [DecodeCell(1, 1024), DecodeCell(256, 32768), ThroughputLoad(), MixedLoad()]
    spec = _spec(tmp_path, workloads)
    result = run_engine_process(spec, StubSession())
    assert result == json.loads(Path(spec.result_path).read_text())
    by_name = {w["workload"]: w for w in result["workloads"]}
    assert result["status"] == "done" and len(by_name) == 4
    assert by_name["decode b1 1k"]["tpot_ms"]["median"] == pytest.approx(1.01)
    too_big, failing = by_name["decode b256 32k"], by_name["throughput 256x128/512"]
    assert too_big["status"] == "skipped" and "KV-cache tokens" in too_big["reason"]
    assert failing["status"] == "error" and "out of memory" in failing["error"]
    assert by_name["mixed 64x1k + 8x16k"]["status"] == "error"  # the stand-in has no mixed load


def test_engine_process_loop_reads_each_workload_s_host_timers(tmp_path):
    class Timed(StubSession):
        reads = 0

        def host_timings(self):  # one interval per workload: read (and reset) before and after it
            self.reads += 1
            return [{"rank": 0, "ranges": {"mla_backend.vllm.build_decode": {"calls": self.reads, "p50_us": 20.0,
                                                                             "p99_us": 30.0, "max_us": 31.0}}}]

    result = run_engine_process(_spec(tmp_path, [DecodeCell(1, 1024), DecodeCell(2, 1024)]), Timed())
    first, second = result["workloads"]
    assert first["host_timers"][0]["ranges"]["mla_backend.vllm.build_decode"]["calls"] == 2
    assert second["host_timers"][0]["ranges"]["mla_backend.vllm.build_decode"]["calls"] == 4
    assert "host_timers" not in run_engine_process(_spec(tmp_path, [DecodeCell(1, 1024)]),
                                                   StubSession())["workloads"][0]


def test_engine_process_loop_collects_each_rank_s_verification_only_under_verify(tmp_path):
    class Verifying(StubSession):
        def verification(self):
            return [{"rank": 0, "calls": 7, "max_rel_err": 1e-3, "max_lse_err": 1e-4}]

    assert "verification" not in run_engine_process(_spec(tmp_path, [DecodeCell(1, 1024)]), Verifying())
    result = run_engine_process(_spec(tmp_path, [DecodeCell(1, 1024)], verify=True), Verifying())
    assert result["status"] == "done" and result["verification"][0]["calls"] == 7


def test_engine_process_loop_reports_a_refusal_and_the_time_budget(tmp_path):
    class Refusing(StubSession):
        def start(self):
            raise RuntimeError("Engine core initialization failed. See root cause above.")

    spec = _spec(tmp_path, [DecodeCell(1, 1024)])
    Path(spec.log_path).write_text("ValueError: Selected backend STUB is not valid for this configuration. Reason: "
                                   "['compute capability not supported']\n")
    result = run_engine_process(spec, Refusing())
    assert result["status"] == "refused" and "compute capability not supported" in result["reason"]
    late = _spec(tmp_path, [DecodeCell(1, 1024)], deadline=time.time() + 1)
    assert run_engine_process(late, StubSession())["workloads"][0]["reason"] == "time budget"


# ----------------------------------------------------------------------------- command line
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit status where there is no GPU")
def test_no_gpu_exits_with_status_2_and_says_why(capsys):
    assert cli.main(["serve-bench", "--engine", "vllm"]) == cli.NOTHING_RAN == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_dry_run_lists_the_workloads_without_a_gpu(capsys):
    assert cli.main(["serve-bench", "--engine", "sglang", "--heads", "32", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tilelang_mla, flashmla, fa3, triton, flashinfer" in out and "32 heads, 8 layers" in out
    assert "decode b256 32k" in out and "mixed 64x1k + 8x16k" in out and "--verify" not in out
    assert cli.main(["serve-bench", "--engine", "vllm", "--verify", "--dry-run"]) == 0
    assert "every engine eager, each decode call of ours checked by the fp32 reference" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the engines' own argument classes
def _engine_spec(engine: str, backend: str, model_dir: Path, tmp_path: Path, kv: str = "auto",
                 init: str = "dummy", verify: bool = False) -> EngineSpec:
    args = driver.build_parser().parse_args(["--engine", engine, "--kv-cache-dtype", kv, "--init", init]
                                            + (["--verify"] if verify else []))
    run = driver.resolve(args)
    return driver.engine_spec(run, backend, model_dir, tmp_path, tmp_path / "out", in_process=False,
                              hard_deadline=time.time() + 60)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")
@pytest.mark.parametrize("kv,init,verify", [("auto", "dummy", False), ("fp8", "scaled", False),
                                            ("auto", "dummy", True)])
def test_vllm_engine_args_accept_the_runner_s_arguments(tmp_path, kv, init, verify):
    import typing

    from vllm.config.cache import CacheDType
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_dir = write_model_dir(tmp_path / "model", heads=32, layers=4)
    for backend in vllm_runner.ENGINE.backends:
        assert AttentionBackendEnum[backend].name == backend  # a name vLLM 0.26 knows
        spec = _engine_spec("vllm", backend, model_dir, tmp_path, kv, init, verify)
        args = EngineArgs(**vllm_runner.engine_kwargs(spec))
        assert spec.verify == verify and args.enforce_eager == verify  # no CUDA graph hides a call from the check
        assert args.attention_backend == backend and args.enable_prefix_caching is False
        assert args.skip_tokenizer_init and args.disable_log_stats is False
        assert args.kv_cache_dtype == ("fp8" if kv == "fp8" else "auto") and args.block_size == 64
        assert args.kv_cache_dtype in typing.get_args(CacheDType)  # EngineArgs checks names, not values
        assert args.profiler_config.max_iterations == spec.measure_plan.profile_steps
    model = args.create_model_config()  # vLLM reads the generated config.json
    assert model.use_mla and model.hf_config.num_attention_heads == 32 and model.hf_config.num_hidden_layers == 4
    assert model.max_model_len == spec.max_model_len
    assert model.hf_config.kv_lora_rank == 512 and model.hf_config.qk_rope_head_dim == 64
    assert args.load_format == ("mla_scaled_dummy" if init == "scaled" else "dummy")
    assert args.worker_extension_cls  # every engine: the per-rank reports (verification, host timers)


WORKER_PROCESS = """
import sys
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader
from vllm.utils.import_utils import resolve_obj_by_qualname
extension = resolve_obj_by_qualname(sys.argv[1])  # what every vLLM worker does before it loads the model
public = [a for a in dir(extension) if not a.startswith("__")]
assert public and all(a.startswith("mla_backend_") for a in public), public  # none clashes with the worker's own
worker = type("Worker", (extension,), {"rank": 1})()  # vLLM adds the extension to its worker's bases
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
try:  # every MLA backend's per-step build, timed (under MLA_BACKEND_HOST_TIMERS=1) even when it raises
    MLACommonMetadataBuilder.build(object(), common_prefix_len=0, common_attn_metadata=None)
except AttributeError:
    pass
from vllm.model_executor.layers.attention.mla_attention import MLACommonBaseImpl
class Impl(MLACommonBaseImpl):  # a backend's impl: its own forward_mqa, wrapped when its first layer is built
    def forward_mqa(self, *args):
        return "decoded"
try:
    Impl()
except TypeError:  # the base's required arguments
    pass
assert Impl.forward_mqa(None) == "decoded"
timings = worker.mla_backend_host_timings()
timed = {name: t["calls"] for name, t in timings["ranges"].items()} if timings else None
assert timings is None or timings["threads"]["threads"][0]["main"]  # this process's main thread, read with them
print(worker.mla_backend_verification(), timed)
print(type(get_model_loader(LoadConfig(load_format=sys.argv[2]))).__name__)
"""


def test_importing_serve_bench_loads_no_engine():
    """The worker extension registers the load format when imported; nothing else may import it (it loads vLLM's
    model loaders, which SGLang-only environments cannot import)."""
    code = ("import sys, mla_backend.serve_bench.driver, mla_backend.serve_bench.hostile_vllm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang') "
            "or m.endswith('vllm_worker_extension')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")
@pytest.mark.parametrize("verify", [False, True])
def test_scaled_weights_load_format_is_known_in_a_fresh_worker_process(verify):
    """Spawned tensor-parallel workers share no registration with the benchmark's process: the worker extension's
    import must make the load format known there. Its RPC gives the worker's verification report and host timers (None
    while off): with the timers on, every MLA backend's per-step build and per-layer decode call are timed."""
    from mla_backend.serve_bench.random_weights import vllm_worker_kwargs

    kwargs = vllm_worker_kwargs()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("MLA_BACKEND_VERIFY", None)
    env.pop("MLA_BACKEND_HOST_TIMERS", None)
    if verify:
        env.update(MLA_BACKEND_VERIFY="1", MLA_BACKEND_HOST_TIMERS="1")
    done = subprocess.run([sys.executable, "-c", WORKER_PROCESS, kwargs["worker_extension_cls"],
                           kwargs["load_format"]], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report, loader = done.stdout.strip().splitlines()[-2:]
    assert loader == "ScaledDummyModelLoader"
    assert report == ("{'calls': 0, 'max_rel_err': 0.0, 'max_lse_err': 0.0, 'calls_by_q_len': {}, "
                      "'fp8_compute_calls': 0, 'over_limit': 0, 'rank': 1} "
                      "{'mla_backend.vllm.decode_call': 1, 'mla_backend.vllm.metadata_build': 1}" if verify
                      else "None None")


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not importable (CI: PYTHONPATH=.ci/sglang-site)")
@pytest.mark.parametrize("kv,verify", [("auto", False), ("fp8", False), ("auto", True)])
def test_sglang_server_args_accept_the_runner_s_arguments(tmp_path, kv, verify):
    import argparse

    from sglang_cpu_env import prepare_cpu_torchvision

    prepare_cpu_torchvision()
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.server_args import ServerArgs

    from mla_backend.sglang_plugin import register

    register()  # what the runner does before the engine builds its ServerArgs
    cli = argparse.ArgumentParser()
    ServerArgs.add_cli_args(cli)
    choices = {a.dest: a.choices for a in cli._actions if a.choices}  # ServerArgs checks names, the CLI values
    model_dir = write_model_dir(tmp_path / "model", heads=16, layers=4)
    for backend in sglang_runner.ENGINE.backends:
        spec = _engine_spec("sglang", backend, model_dir, tmp_path, kv, verify=verify)
        kwargs = sglang_runner.server_kwargs(spec)
        for key, value in kwargs.items():
            assert key not in choices or value in choices[key], (key, value, choices[key])
        server_args = ServerArgs(**kwargs)
        assert server_args.attention_backend == backend and server_args.page_size == 64
        assert server_args.disable_radix_cache and server_args.skip_tokenizer_init
        assert server_args.kv_cache_dtype == ("fp8_e4m3" if kv == "fp8" else "auto")
        assert server_args.cuda_graph_max_bs_decode == spec.max_num_seqs == 256
        assert server_args.disable_cuda_graph == verify  # no CUDA graph hides a call from the check
    model = ModelConfig.from_server_args(server_args)  # SGLang reads the generated config.json
    assert model.attention_arch == AttentionArch.MLA and model.num_attention_heads == 16
    assert model.kv_lora_rank == 512 and model.qk_rope_head_dim == 64 and model.context_len == spec.max_model_len


def test_streamed_sample_includes_the_last_submitted_request():
    assert sglang_runner.streamed_indices(256) == [0, 36, 73, 109, 146, 182, 219, 255]
    assert sglang_runner.streamed_indices(3) == [0, 1, 2]
    sglang_engine = sys.modules["mla_backend.serve_bench.sglang_runner"].ENGINE
    assert sglang_engine.ours == sglang_runner.ENGINE.backends[0] == "tilelang_mla"
    assert vllm_runner.ENGINE.ours == vllm_runner.ENGINE.backends[0] == "CUSTOM"
