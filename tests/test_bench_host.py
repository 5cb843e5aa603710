"""``mla-backend bench --host`` on the CPU: the cache sweep, the table with and without cold columns, the no-GPU exit."""

import pytest
import torch

from mla_backend import bench_host
from mla_backend.cli import NOTHING_RAN


def test_cache_sweep_writes_one_byte_per_line():
    sweep = bench_host.CacheSweep(1)
    assert len(sweep.buffer) == 1 << 20
    sweep()
    assert set(sweep.buffer[::64]) == {1} and set(sweep.buffer[1::64]) == {0}


def _record(cold: bool):
    impl = {"p50": 10.0, "p99": 20.0, "eager_us": 30.0}
    step = {"plan": 4.0, "vllm_build": 9.0}
    if cold:
        impl["cold"] = {"p50": 50.0, "p99": 90.0}
        step.update(plan_cold=12.0, vllm_build_cold=40.0)
    return {"label": "b=1 s_k=4096 h=16", "impls": {"launcher": impl, "fa3": {"skip": "no vllm"}}, "step": step}


def test_table_hot_only():
    head, rule, row = bench_host.table([_record(False)], ["launcher", "fa3"])
    assert "cold" not in head and head.count("|") == rule.count("|") == row.count("|")
    assert row == "| b=1 s_k=4096 h=16 | 10.0 / 20.0 | 30.0 | – | – | 4.0 | 9.0 |"


def test_table_with_cold_columns():
    head, rule, row = bench_host.table([_record(True)], ["launcher", "fa3"], cold=True)
    assert "launcher cold p50 / p99 µs" in head and "vLLM build µs / cold" in head
    assert head.count("|") == rule.count("|") == row.count("|")
    assert row == "| b=1 s_k=4096 h=16 | 10.0 / 20.0 | 50.0 / 90.0 | 30.0 | – | – | – | 4.0 / 12.0 | 9.0 / 40.0 |"


def test_no_gpu_exits_nothing_ran(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bench --host would time")
    assert bench_host.main(["--evict-mb", "1", "--out-dir", ""]) == NOTHING_RAN
    assert "no CUDA GPU" in capsys.readouterr().err
