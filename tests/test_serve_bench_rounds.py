"""CPU tests of ``serve-bench --rounds`` (mla_backend/serve_bench/rounds.py and the driver's loop): every backend's
engine started once per round in alternating order, each workload's repeats pooled over the engines, each engine's
median kept and shown."""

from __future__ import annotations

import textwrap

import pytest

from mla_backend.serve_bench import driver, report, resume, rounds
from mla_backend.serve_bench.runner_common import measurement
from mla_backend.serve_bench.workloads import DecodeCell
from test_serve_bench import REPORT_ENV

# An engine process that appends its backend to ``order.txt`` and measures a TPOT of 1 ms in its first round, 2 ms in
# its second (the round is in its result file's name), with a profile only where the driver asks for one.
ROUND_RUNNER = '''
import json, os, sys
from mla_backend.serve_bench.runner_common import EngineSpec, measurement, write_result
from mla_backend.serve_bench.workloads import DecodeCell
spec = EngineSpec.load(sys.argv[1])
with open(os.path.join(os.path.dirname(spec.log_path), "order.txt"), "a") as f:
    f.write(spec.backend + "\\n")
tpot = 2.0 if ".round2" in spec.result_path else 1.0
record = measurement(DecodeCell(1, 1024), [{"tpot_ms": tpot + 0.1 * k} for k in range(3)],
                     **({"profile": {"attention_share": 0.3}} if spec.plan.get("profile_steps") else {}))
write_result(spec.result_path, {"backend": spec.backend, "status": "done", "engine_info": {"start_s": tpot},
                                "workloads": [record]})
'''


@pytest.fixture
def round_engine(tmp_path, monkeypatch):
    (tmp_path / "round_runner.py").write_text(textwrap.dedent(ROUND_RUNNER))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(driver, "GPU_RELEASE_S", 0.0)
    return driver.EngineChoice("vllm", "round_runner", ("A", "B"), {"auto": "auto"}, 64, 5.0)


#: One decode cell, so that each stand-in engine measures one workload.
CELL_ARGS = ["--engine", "vllm", "--batches", "1", "--contexts", "1k", "--workloads", "decode"]


def _round_run(round_engine, argv):
    """The driver's run of ``argv`` on the stand-in engine's backends A and B."""
    run = driver.resolve(driver.build_parser().parse_args(argv))
    run.engine, run.backends = round_engine, ("A", "B")
    return run


def _stop_at_round_two(monkeypatch):
    """Makes serve-bench stopped (SIGTERM) as round 2's first engine starts (the third engine); returns the real
    ``measure_engine`` to put back."""
    measure, calls = driver.measure_engine, []

    def stopped_in_round_two(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("SIGTERM")
        return measure(*a, **k)

    monkeypatch.setattr(driver, "measure_engine", stopped_in_round_two)
    return measure


def _kept_by_resume(out, written_by, results, resumed_by=None):
    """``results`` written as ``out``'s report of run ``written_by``, and what ``--resume`` keeps of it for run
    ``resumed_by`` (the same run by default)."""
    report.write_outputs(out, report.assemble(dict(REPORT_ENV), written_by, results, wall_s=1.0))
    resumed_by = resumed_by or written_by
    return resume.kept_backends(out, report.run_settings(resumed_by), resumed_by.model_config,
                                dict(REPORT_ENV, date="later"))


def test_rounds_start_every_backend_again_in_reversed_order_and_pool_the_repeats(tmp_path, round_engine):
    run = _round_run(round_engine, CELL_ARGS + ["--rounds", "2"])
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm", "--rounds", "2"])
    logs = tmp_path / "out" / "vllm-logs"
    assert (logs / "order.txt").read_text().split() == ["A", "B", "B", "A"]
    assert (logs / "A.log").exists() and (logs / "A.round2.log").exists()
    for backend in ("A", "B"):
        record = results[backend]["workloads"][0]
        assert [e["start_s"] for e in results[backend]["engines"]] == [1.0, 2.0]
        assert record["tpot_ms"]["n"] == 6 and record["tpot_ms"]["min"] == 1.0 and record["tpot_ms"]["max"] == 2.2
        assert record["engine_medians"]["tpot_ms"] == pytest.approx([1.1, 2.1])
        assert record["profile"] == {"attention_share": 0.3}  # the first round's; later rounds are not profiled
    text = report.markdown(report.assemble(dict(REPORT_ENV), run, results, wall_s=1.0))
    assert "#### Each engine process's median (2 rounds, the order reversed every other round)" in text
    assert "| decode b1 1k | tpot_ms | 1.10, 2.10 | 1.10, 2.10 |" in text


def test_a_stop_in_a_later_round_keeps_the_earlier_engines_and_names_the_rounds_not_run(tmp_path, round_engine,
                                                                                       monkeypatch):
    run = _round_run(round_engine, CELL_ARGS + ["--rounds", "2"])
    _stop_at_round_two(monkeypatch)  # while round 2's first engine (B) runs
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm", "--rounds", "2"])
    for backend in ("A", "B"):
        assert results[backend]["status"] == "done"
        assert results[backend]["rounds_skipped"] == ["round 2: serve-bench was stopped (SIGTERM)"]
    text = report.markdown(report.assemble(dict(REPORT_ENV), run, results, wall_s=1.0))
    assert "| decode b1 1k | tpot_ms | 1.10 | 1.10 |" in text  # each backend's one engine, not a dash
    assert "- B: round 2: serve-bench was stopped (SIGTERM)" in text


def test_resume_runs_only_the_rounds_an_earlier_stopped_run_lacks(tmp_path, round_engine, monkeypatch):
    argv = CELL_ARGS + ["--rounds", "2"]
    run = _round_run(round_engine, argv)
    out = tmp_path / "out"
    measure = _stop_at_round_two(monkeypatch)
    first = driver.run_backends(run, tmp_path, tmp_path, out, argv)
    monkeypatch.setattr(driver, "measure_engine", measure)
    kept = _kept_by_resume(out, run, first)
    assert sorted(kept) == ["A", "B"] and all(rounds.engines_run(r) == 1 for r in kept.values())
    results = driver.run_backends(run, tmp_path, tmp_path, out, argv + ["--resume"], kept)
    # the first run ran A and B and was stopped as round 2 began; this one starts round 2 only, in its order (B, A)
    assert (out / "vllm-logs" / "order.txt").read_text().split() == ["A", "B", "B", "A"]
    for backend in ("A", "B"):
        result = results[backend]
        assert "rounds_skipped" not in result and result["kept_rounds"] == 1
        assert [e["start_s"] for e in result["engines"]] == [1.0, 2.0]
        assert result["workloads"][0]["engine_medians"]["tpot_ms"] == pytest.approx([1.1, 2.1])
    text = report.markdown(report.assemble(dict(REPORT_ENV), run, results, wall_s=1.0))
    assert "| decode b1 1k | tpot_ms | 1.10, 2.10 | 1.10, 2.10 |" in text and "Engines not measured" not in text
    assert "its first 1 engine(s) kept from the run of 2026-12-01T10:00:00+00:00" in text
    # a report with every round is kept whole: nothing starts
    kept = _kept_by_resume(out, run, results)
    again = driver.run_backends(run, tmp_path, tmp_path, out, argv + ["--resume"], kept)
    assert (out / "vllm-logs" / "order.txt").read_text().split() == ["A", "B", "B", "A"]
    assert all(rounds.engines_run(r) == 2 for r in again.values())


def test_a_later_round_that_does_not_fit_the_budget_starts_none_of_its_engines(tmp_path, round_engine, monkeypatch):
    # Each stand-in engine takes 100 s of a fake clock. Budget 350: round 1 ends at 200 s; round 2's second engine
    # would not fit, so neither starts (one backend with more engines than the other would weigh the pooled medians).
    now = [1000.0]

    class Clock:
        @staticmethod
        def time():
            return now[0]

    def measure_engine(run, spec, work):
        now[0] += 100.0
        record = measurement(DecodeCell(1, 1024), [{"tpot_ms": 1.0}] * 3)
        return {"backend": spec.backend, "status": "done", "wall_s": 100.0, "engine_info": {"start_s": 1.0},
                "workloads": [record]}

    monkeypatch.setattr(driver, "time", Clock)
    monkeypatch.setattr(driver, "measure_engine", measure_engine)
    argv = CELL_ARGS + ["--rounds", "2", "--budget", "350"]
    results = driver.run_backends(_round_run(round_engine, argv), tmp_path, tmp_path, tmp_path / "out", argv)
    for backend in ("A", "B"):
        assert rounds.engines_run(results[backend]) == 1
        assert results[backend]["rounds_skipped"] == [
            "round 2: time budget: 200 of 350 s used and its 2 engines take about 200 s"]
    # with room for the whole round, both engines of round 2 start
    now[0] = 1000.0
    argv[-1] = "450"
    results = driver.run_backends(_round_run(round_engine, argv), tmp_path, tmp_path, tmp_path / "out2", argv)
    assert all(rounds.engines_run(r) == 2 and "rounds_skipped" not in r for r in results.values())


def test_resume_with_more_rounds_adds_engines_to_a_report_of_one_engine_per_backend(tmp_path, round_engine):
    one, two = _round_run(round_engine, CELL_ARGS), _round_run(round_engine, CELL_ARGS + ["--rounds", "2"])
    out = tmp_path / "out"
    kept = _kept_by_resume(out, one, driver.run_backends(one, tmp_path, tmp_path, out, CELL_ARGS), resumed_by=two)
    results = driver.run_backends(two, tmp_path, tmp_path, out, CELL_ARGS + ["--rounds", "2", "--resume"], kept)
    assert (out / "vllm-logs" / "order.txt").read_text().split() == ["A", "B", "B", "A"]
    for backend in ("A", "B"):
        assert results[backend]["kept_rounds"] == 1 and rounds.engines_run(results[backend]) == 2
        assert results[backend]["workloads"][0]["engine_medians"]["tpot_ms"] == pytest.approx([1.1, 2.1])
    # a setting that is not free still refuses
    other = report.run_settings(driver.resolve(driver.build_parser().parse_args(CELL_ARGS + ["--repeats", "5"])))
    with pytest.raises(ValueError, match="measured something else"):
        resume.kept_backends(out, other, two.model_config, dict(REPORT_ENV, date="later"))


def test_pooling_keeps_what_an_engine_did_not_measure_and_records_failed_engines():
    cell = DecodeCell(1, 1024)
    first = {"status": "done", "engine_info": {"start_s": 30.0}, "wall_s": 60.0,
             "workloads": [measurement(cell, [{"tpot_ms": 1.0}] * 3, prefill_s=0.5),
                           {"workload": "forced 32x1024/64", "kind": "forced", "status": "ok", "agreement": 0.97}]}
    later = {"status": "done", "engine_info": {"start_s": 31.0}, "wall_s": 61.0,
             "workloads": [{"workload": cell.name, "kind": cell.kind, "status": "error", "error": "CUDA error"}]}
    pooled = rounds.pool(first, later)
    assert pooled["workloads"] == first["workloads"]  # the later engine's error leaves the first's record
    failed = rounds.pool(pooled, {"status": "failed", "reason": "the engine process exited with status 1",
                                  "workloads": []})
    assert [e["status"] for e in failed["engines"]] == ["done", "done", "failed"]
    assert failed["engines"][2]["reason"].startswith("the engine process exited")
    third = rounds.pool(failed, {"status": "done", "workloads": [measurement(cell, [{"tpot_ms": 3.0}] * 3)]})
    record = third["workloads"][0]
    assert record["engine_medians"]["tpot_ms"] == [1.0, 3.0] and record["prefill_s"] == 0.5
    assert third["workloads"][1] == first["workloads"][1]  # the forced check has no repeats to pool
    assert rounds.round_order(("A", "B", "C"), 1) == ("C", "B", "A") and rounds.round_order(("A", "B"), 2) == ("A", "B")


def test_a_workload_the_first_engine_skipped_takes_the_later_engine_s_measurement():
    cell = DecodeCell(256, 8192)
    first = {"status": "done", "engine_info": {"start_s": 30.0}, "wall_s": 60.0,
             "workloads": [{"workload": cell.name, "kind": cell.kind, "status": "skipped", "reason": "time budget"}]}
    later = {"status": "done", "engine_info": {"start_s": 31.0}, "wall_s": 61.0,
             "workloads": [measurement(cell, [{"tpot_ms": 10.0 + k} for k in range(3)])]}
    record = rounds.pool(first, later)["workloads"][0]
    assert record["status"] == "ok" and record["tpot_ms"]["median"] == 11.0 and record["tpot_ms"]["n"] == 3
    assert record["engine_medians"]["tpot_ms"] == [None, 11.0]  # the first engine measured nothing
    third = rounds.pool(rounds.pool(first, later), {"status": "done", "workloads": [
        measurement(cell, [{"tpot_ms": 20.0}] * 3)]})["workloads"][0]
    assert third["engine_medians"]["tpot_ms"] == [None, 11.0, 20.0] and third["tpot_ms"]["n"] == 6


def test_rounds_must_be_positive_and_only_several_enter_the_settings():
    parser = driver.build_parser()
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        driver.resolve(parser.parse_args(["--engine", "vllm", "--rounds", "0"]))
    one = report.run_settings(driver.resolve(parser.parse_args(["--engine", "vllm"])))
    assert "rounds" not in one  # a report of one engine per backend resumes as before
    assert report.run_settings(driver.resolve(parser.parse_args(["--engine", "vllm", "--rounds", "3"])))["rounds"] == 3


def test_dry_run_names_the_rounds():
    parser = driver.build_parser()
    lines = driver.describe_run(driver.resolve(parser.parse_args(["--engine", "vllm", "--rounds", "2"])))
    assert any(line.endswith("; 2 engine processes per backend (rounds)") for line in lines)
    assert not any("rounds" in line for line in driver.describe_run(driver.resolve(parser.parse_args(
        ["--engine", "vllm"]))))
