"""CPU tests of ``mla-backend serve-bench``'s driver with stand-in engine processes written here (no engine runs;
nothing of vLLM or SGLang is replaced): one process per backend, the time budget, refusals, a killed or stopped
engine and the processes it left, ``--verify`` reaching the engines, their environment, and ``--resume``.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from mla_backend.serve_bench import driver, report, resume, verification
from test_serve_bench import REPORT_ENV

# ----------------------------------------------------------------------------- the driver's orchestration
STUB_RUNNER = '''
import json, os, sys, time
from mla_backend.serve_bench.runner_common import EngineSpec, write_result
spec = EngineSpec.load(sys.argv[1])
if spec.backend == "SLOW":
    write_result(spec.result_path, {"backend": spec.backend, "status": "running", "workloads": []})
    time.sleep(60)
elif spec.backend == "DETACHED":  # a worker that left the engine's process group, as an engine's workers may
    import subprocess
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    open(spec.result_path + ".worker", "w").write(str(worker.pid))
    time.sleep(60)
elif spec.backend == "OOM":  # as torch reports it, then the engine's shutdown lines
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 27.93 GiB.", flush=True)
    for i in range(2000):
        print(f"shutting down {i}")
    sys.exit(1)
elif spec.backend == "NOPE":
    write_result(spec.result_path, {"backend": spec.backend, "status": "refused", "reason": "not on this GPU",
                                    "workloads": []})
else:
    result = {"backend": spec.backend, "status": "done", "engine_info": {"start_s": 0.1},
              "workloads": [{"workload": "decode b1 1k", "status": "ok",
                             "tpot_ms": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}}]}
    if spec.verify:  # each rank checks calls only where the driver turned the check on in its environment
        checked = int(os.environ.get("MLA_BACKEND_VERIFY") == "1")
        result["verification"] = [{"rank": r, "calls": checked, "max_rel_err": 1e-3, "max_lse_err": 1e-4}
                                  for r in range(2)]
    write_result(spec.result_path, result)
'''


@pytest.fixture
def stub_engine(tmp_path, monkeypatch):
    """An engine choice whose engine process is the stand-in above (a module on PYTHONPATH)."""
    (tmp_path / "stub_runner.py").write_text(textwrap.dedent(STUB_RUNNER))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(driver, "GPU_RELEASE_S", 0.0)
    monkeypatch.setattr(driver, "KILL_GRACE_S", 1.0)
    return driver.EngineChoice("vllm", "stub_runner", ("OURS", "NOPE", "SLOW"), {"auto": "auto"}, 64, 5.0)


def _stub_run(stub_engine, backends, budget, *extra):
    args = driver.build_parser().parse_args(["--engine", "vllm", "--batches", "1", "--contexts", "1k",
                                             "--workloads", "decode", "--budget", str(budget), *extra])
    run = driver.resolve(args)
    run.engine, run.backends = stub_engine, backends
    return run


def test_driver_runs_each_backend_in_its_own_process(tmp_path, stub_engine):
    run = _stub_run(stub_engine, ("OURS", "NOPE"), budget=600)
    argv = ["--engine", "vllm", "--backends", "OURS,NOPE"]
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", argv)
    assert results["OURS"]["status"] == "done" and results["OURS"]["exit_code"] == 0
    assert results["NOPE"] == {**results["NOPE"], "status": "refused", "reason": "not on this GPU"}
    assert (tmp_path / "out" / "vllm-logs" / "OURS.log").exists()


def test_driver_verify_turns_the_check_on_in_every_engine_process(tmp_path, stub_engine, monkeypatch):
    monkeypatch.delenv("MLA_BACKEND_VERIFY", raising=False)
    run = _stub_run(stub_engine, ("OURS",), 600, "--verify")
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm", "--verify"])
    data = report.assemble(dict(REPORT_ENV), run, results, wall_s=1.0)
    data["settings"]["ours"] = "OURS"
    checked = verification.verdict(data)
    assert checked["passed"] is True and [r["calls"] for r in checked["ranks"]] == [1, 1]


def test_driver_kills_an_engine_at_the_budget_and_skips_what_would_not_fit(tmp_path, stub_engine):
    run = _stub_run(stub_engine, ("SLOW", "OURS"), budget=2)
    argv = ["--engine", "vllm", "--budget", "2"]
    t0 = time.perf_counter()
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", argv)
    # killed at the budget plus the grace period (shortened here), not after its 60 s
    assert results["SLOW"]["status"] == "failed" and "time budget" in results["SLOW"]["reason"]
    assert results["OURS"]["status"] == "skipped"
    assert "mla-backend serve-bench --engine vllm --budget 2 --backends OURS --resume" in results["OURS"]["reason"]
    assert time.perf_counter() - t0 < driver.KILL_GRACE_S + 30


def test_an_engine_out_of_gpu_memory_is_reported_with_what_to_change(tmp_path, stub_engine):
    run = _stub_run(stub_engine, ("OOM", "OURS"), 600, "--gpu-memory-fraction", "0.8")
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm"])
    reason = results["OOM"]["reason"]
    assert results["OOM"]["status"] == "failed" and "exited with status 1" in reason, reason
    assert "CUDA out of memory" in reason and "--gpu-memory-fraction below 0.8" in reason, reason
    assert "fp8 pool" not in reason  # the SGLang fp8-pool remark is for SGLang engines with an fp8 pool only
    assert results["OURS"]["status"] == "done"


@pytest.mark.parametrize("engine,kv_cache_dtype,remark", [("sglang", "fp8_e4m3", True), ("sglang", "auto", False),
                                                          ("vllm", "fp8", False)])
def test_out_of_memory_hint_names_sglang_s_fp8_prefill_conversion_where_it_applies(engine, kv_cache_dtype, remark):
    spec = driver.EngineSpec(engine=engine, backend="x", model_dir="m", vocab_size=1, result_path="r", log_path="l",
                             profile_dir="p", kv_cache_dtype=kv_cache_dtype, gpu_memory_fraction=0.85)
    hint = driver.out_of_memory_hint(spec)
    assert "--gpu-memory-fraction below 0.85" in hint
    assert ("converts a layer's whole pool to bf16" in hint) is remark


def test_engines_use_no_nvlink_multicast_where_nccl_has_it_off(monkeypatch):
    name, backend = driver.FLASHINFER_ALLREDUCE_WITHOUT_MULTICAST
    monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert name not in driver.child_env()
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert driver.child_env()[name] == backend == "trtllm"
    monkeypatch.setenv(name, "mnnvl")  # the user's choice stands
    assert driver.child_env()[name] == "mnnvl"


def test_engines_compile_deepgemm_on_first_use_unless_the_user_chose(monkeypatch):
    name, value = driver.DEEPGEMM_PRECOMPILE_OFF
    monkeypatch.delenv(name, raising=False)
    assert driver.child_env()[name] == value == "0"
    monkeypatch.setenv(name, "1")
    assert driver.child_env()[name] == "1"


def test_verify_reaches_the_engine_processes_only_when_asked(monkeypatch):
    monkeypatch.delenv("MLA_BACKEND_VERIFY", raising=False)
    assert "MLA_BACKEND_VERIFY" not in driver.child_env()
    assert driver.child_env(verify=True)["MLA_BACKEND_VERIFY"] == "1"


def test_host_timers_are_on_in_the_engine_processes_unless_the_user_turned_them_off(monkeypatch):
    monkeypatch.delenv("MLA_BACKEND_HOST_TIMERS", raising=False)
    assert driver.child_env()["MLA_BACKEND_HOST_TIMERS"] == "1"
    monkeypatch.setenv("MLA_BACKEND_HOST_TIMERS", "0")
    assert driver.child_env()["MLA_BACKEND_HOST_TIMERS"] == "0"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_driver_ends_its_engine_and_keeps_what_was_measured(tmp_path, stub_engine):
    """``timeout`` sends SIGTERM: the running engine is ended, finished backends stay, the rest are listed."""
    import signal
    import threading

    run = _stub_run(stub_engine, ("OURS", "SLOW", "NOPE"), budget=600)
    previous = signal.signal(signal.SIGTERM, driver._interrupt)
    try:
        def stop_once_slow_runs():
            deadline = time.monotonic() + 120
            while not (tmp_path / "SLOW.result.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=stop_once_slow_runs, daemon=True).start()
        t0 = time.perf_counter()
        results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert time.perf_counter() - t0 < 50  # not the stand-in's 60 s
    assert results["OURS"]["status"] == "done"
    assert results["SLOW"]["status"] == "failed" and "stopped (signal 15)" in results["SLOW"]["reason"]
    assert results["NOPE"]["status"] == "skipped" and "--backends NOPE --resume" in results["NOPE"]["reason"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds an engine's processes through /proc")
def test_driver_ends_an_engine_s_processes_that_left_its_group(tmp_path, stub_engine):
    run = _stub_run(stub_engine, ("DETACHED",), budget=3)
    driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm"])
    worker = int(Path(str(tmp_path / "DETACHED.result.json") + ".worker").read_text())
    deadline = time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(worker)


def test_alone_command_replaces_the_backend_list_and_resumes():
    assert driver.alone_command(["--engine", "sglang", "--backends", "a,b", "--heads", "32"], "b") == \
        "mla-backend serve-bench --engine sglang --heads 32 --backends b --resume"
    assert driver.alone_command(["--engine", "vllm", "--backends=a", "--resume"], "a") == \
        "mla-backend serve-bench --engine vllm --resume --backends a"


def _report_of(run, results, env):
    return report.assemble(dict(env), run, results, wall_s=1.0)


def test_resume_keeps_finished_backends_and_runs_only_the_rest(tmp_path, stub_engine):
    out = tmp_path / "out"
    first = _stub_run(stub_engine, ("OURS", "NOPE"), budget=600)
    report.write_outputs(out.mkdir() or out, _report_of(first, driver.run_backends(first, tmp_path, tmp_path, out,
                                                                                 ["--engine", "vllm"]), REPORT_ENV))
    second = _stub_run(stub_engine, ("NOPE", "OURS"), budget=600)
    kept = resume.kept_backends(out, report.run_settings(second), second.model_config, dict(REPORT_ENV, date="later"))
    assert list(kept) == ["OURS"] and kept["OURS"]["from_run"]["date"] == REPORT_ENV["date"]  # NOPE was refused
    (out / "vllm-logs" / "OURS.log").unlink()
    results = driver.run_backends(second, tmp_path, tmp_path, out, ["--engine", "vllm"], kept)
    assert list(results) == ["NOPE", "OURS"] and results["OURS"] is kept["OURS"]
    assert not (out / "vllm-logs" / "OURS.log").exists()  # no engine started for the kept backend
    assert "kept from the run of 2026-12-01T10:00:00+00:00" in report.markdown(_report_of(second, results, REPORT_ENV))
    # a kept backend that is not asked for stays in the report
    only_nope = _stub_run(stub_engine, ("NOPE",), budget=600)
    assert list(driver.run_backends(only_nope, tmp_path, tmp_path, out, [], kept)) == ["NOPE", "OURS"]


def test_resume_refuses_a_report_that_measured_something_else(tmp_path, stub_engine):
    first = _stub_run(stub_engine, ("OURS",), budget=600)
    report.write_outputs(tmp_path, _report_of(first, {"OURS": {"status": "done", "workloads": []}}, REPORT_ENV))
    args = driver.build_parser().parse_args(["--engine", "vllm", "--batches", "1", "--contexts", "1k",
                                             "--workloads", "decode", "--heads", "32"])
    other = driver.resolve(args)
    with pytest.raises(ValueError, match=r"measured something else.*heads: 16 -> 32"):
        resume.kept_backends(tmp_path, report.run_settings(other), other.model_config, REPORT_ENV)
    with pytest.raises(ValueError, match=r"gpu: 'H100' -> 'H200'"):
        resume.kept_backends(tmp_path, report.run_settings(first), first.model_config, dict(REPORT_ENV, gpu="H200"))
    assert resume.kept_backends(tmp_path / "empty", report.run_settings(first), first.model_config, REPORT_ENV) == {}
