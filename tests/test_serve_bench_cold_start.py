"""CPU tests of serve-bench's cold-start handling: the engines' compile caches tell whether an engine compiled in its
start or warm-up (vllm_runner.compile_cache_counts, sglang_runner.compile_cache_dirs); such an engine ends and the
driver measures a second, warm start (``--cold-start restart``), or the report flags it (``--cold-start measure``)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from mla_backend.serve_bench import driver, report
from mla_backend.serve_bench.runner_common import COMPILED, run_engine_process
from mla_backend.serve_bench.workloads import DecodeCell, MeasurePlan
import test_serve_bench_driver
from test_serve_bench import REPORT_ENV, StubSession, _spec, _synthetic_report
from test_serve_bench_driver import _stub_run

stub_engine = test_serve_bench_driver.stub_engine  # the fixture: an engine choice whose engine process is a stand-in


class ColdSession(StubSession):
    """A start that compiled the graphs (vLLM's compile cache grew during it)."""

    stopped = 0

    def start(self):
        return {"kv_capacity_tokens": self.kv_capacity_tokens, "compiled_at_start": True, "start_s": 150.0}

    def shutdown(self):
        self.stopped += 1


class LazyJitSession(ColdSession):
    """A warm start whose first requests compile a kernel (SGLang's fp8 KV-cache write builds in the first forward)."""

    def start(self):
        self.warmed = False
        return {"kv_capacity_tokens": self.kv_capacity_tokens, "compiled_at_start": False, "start_s": 40.0}

    def warmup(self):
        self.warmed = True

    def compiled_since_start(self):
        return ["/cache/tvm-ffi"] if self.warmed else []


@pytest.mark.parametrize("session_class", [ColdSession, LazyJitSession])
@pytest.mark.parametrize("restart", [True, False])
def test_an_engine_that_compiled_at_start_ends_before_any_workload_when_asked(tmp_path, restart, session_class):
    session = session_class()
    result = run_engine_process(_spec(tmp_path, [DecodeCell(1, 1024)], restart_cold=restart), session)
    assert session.stopped == 1 and result["engine_info"]["compiled_at_start"] is True
    assert json.loads((tmp_path / "result.json").read_text()) == result
    if restart:
        assert result["status"] == COMPILED and result["workloads"] == []
    else:
        assert result["status"] == "done" and [w["status"] for w in result["workloads"]] == ["ok"]


COLD_RUNNER = '''
import os, sys
from mla_backend.serve_bench.runner_common import EngineSpec, write_result
spec = EngineSpec.load(sys.argv[1])
marker = spec.result_path + ".compiled"
print("engine log of", "a warm start" if os.path.exists(marker) else "the first start")
if spec.restart_cold and not os.path.exists(marker):  # the first start fills the compile cache
    open(marker, "w").close()
    write_result(spec.result_path, {"backend": spec.backend, "status": "compiled", "workloads": [],
                                    "engine_info": {"start_s": 150.0, "compiled_at_start": True,
                                                    "grown_caches": ["/root/.triton/cache"]}})
else:
    write_result(spec.result_path, {"backend": spec.backend, "status": "done", "engine_info": {"start_s": 60.0},
                                    "workloads": [{"workload": "decode b1 1k", "status": "ok",
                                                   "tpot_ms": {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1}}]})
'''


@pytest.mark.parametrize("cold_start", ["restart", "measure"])
def test_driver_measures_a_second_start_of_an_engine_that_compiled(tmp_path, stub_engine, cold_start):
    (tmp_path / "stub_runner.py").write_text(COLD_RUNNER)
    run = _stub_run(stub_engine, ("OURS",), 600, "--cold-start", cold_start)
    results = driver.run_backends(run, tmp_path, tmp_path, tmp_path / "out", ["--engine", "vllm"])
    logs = tmp_path / "out" / "vllm-logs"
    assert results["OURS"]["status"] == "done"
    if cold_start == "restart":
        assert results["OURS"]["engine_info"] == {"start_s": 60.0, "cold_start_s": 150.0,
                                                  "cold_start_caches": ["/root/.triton/cache"]}
        assert "a warm start" in (logs / "OURS.log").read_text()
        assert "the first start" in (logs / "OURS.cold.log").read_text()
        data = report.assemble(dict(REPORT_ENV), run, results, wall_s=1.0)
        assert ("measured on its second start: the first (150.0 s) filled a compile cache (`/root/.triton/cache`)"
                in report.markdown(data))
    else:
        assert results["OURS"]["engine_info"] == {"start_s": 60.0} and not (logs / "OURS.cold.log").exists()


def test_engine_table_flags_an_engine_that_compiled_at_its_start():
    data = _synthetic_report()
    assert report.COLD_START_NOTE not in report.markdown(data)
    data["backends"]["FLASHMLA"]["engine_info"]["compiled_at_start"] = True
    assert f"| FLASHMLA | done | 75.0 | – | – | {report.COLD_START_NOTE} |" in report.markdown(data)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (CI: .ci/install_vllm.sh)")
def test_compile_cache_counts_vllm_s_torch_compile_cache(tmp_path, monkeypatch):
    from mla_backend.serve_bench.vllm_runner import compile_cache_counts

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert sum(compile_cache_counts().values()) == 0
    graphs = tmp_path / "torch_compile_cache" / "abc123" / "rank_0_0" / "backbone"
    graphs.mkdir(parents=True)
    (graphs / "computation_graph.py").write_text("")
    (tmp_path / "torch_compile_cache" / "abc123" / "cache_key_factors.json").write_text("{}")
    (tmp_path / "modelinfos.json").write_text("{}")  # elsewhere in vLLM's cache: not a compiled graph
    assert compile_cache_counts() == {str(tmp_path / "torch_compile_cache"): 2}


def test_sglang_start_is_judged_by_the_jit_caches_it_fills(tmp_path, monkeypatch):
    from mla_backend.serve_bench.runner_common import cache_counts, grown_caches
    from mla_backend.serve_bench.sglang_runner import compile_cache_dirs

    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "DG_JIT_CACHE_DIR", "TILELANG_CACHE_DIR",
                 "TVM_FFI_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "fi"))
    dirs = compile_cache_dirs()
    assert str(tmp_path / "fi" / ".cache" / "flashinfer") in dirs and str(tmp_path / "tilelang_cache_dir") in dirs
    before = cache_counts(dirs)
    assert sum(before.values()) == 0  # none exists yet
    kernel = tmp_path / "triton_cache_dir" / "ab12"
    kernel.mkdir(parents=True)
    (kernel / "kernel.cubin").write_bytes(b"")
    (tmp_path / "fi" / ".cache" / "flashinfer" / "90a").mkdir(parents=True)
    (tmp_path / "fi" / ".cache" / "flashinfer" / "90a" / "mla.so").write_bytes(b"")
    jit = tmp_path / "tvm_ffi_cache_dir" / "sgl_kernel_jit_store_fp8"  # SGLang's own JIT kernels
    jit.mkdir(parents=True)
    (jit / "store.so").write_bytes(b"")
    (tmp_path / "elsewhere.txt").write_text("")  # outside every cache
    assert sum(cache_counts(dirs).values()) == 3
    assert grown_caches(before, cache_counts(dirs)) == [
        str(tmp_path / "triton_cache_dir"), str(tmp_path / "fi" / ".cache" / "flashinfer"),
        str(tmp_path / "tvm_ffi_cache_dir")]


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")
def test_seeding_the_package_s_kernels_before_a_start_copies_every_variant_once(tmp_path, monkeypatch):
    """serve-bench's SGLang session seeds the prebuilt kernels before it counts the caches, so a copy from the package
    never reads as a compile at start."""
    from mla_backend.kernels import prebuilt

    release = tmp_path / "prebuilt" / prebuilt.installed_tilelang()
    variants = {prebuilt.variant_name(32, 1, 64, "bfloat16", "bfloat16"): ["k0", "kc"],
                prebuilt.variant_name(32, 2, 64, "bfloat16", "bfloat16"): ["k1", "kc"]}
    for key in ("k0", "k1", "kc"):
        (release / "entries" / key).mkdir(parents=True)
        (release / "entries" / key / "executable.so").write_bytes(key.encode())
    (release / prebuilt.MANIFEST).write_text(json.dumps({"tilelang": prebuilt.installed_tilelang(),
                                                         "cache_subdir": "v-x/kernels", "variants": variants}))
    monkeypatch.setattr(prebuilt, "PACKAGE_DIR", tmp_path / "prebuilt")
    monkeypatch.setattr(prebuilt, "_manifest", None)
    monkeypatch.setattr(prebuilt, "_tilelang_cache_dir", lambda: tmp_path / "cache")
    from mla_backend.serve_bench.runner_common import cache_counts

    assert prebuilt.seed_all() == 2
    cached = tmp_path / "cache" / "v-x" / "kernels"
    assert sorted(p.name for p in cached.iterdir()) == ["k0", "k1", "kc"]
    assert (cached / "k1" / "executable.so").read_bytes() == b"k1"
    before = cache_counts([tmp_path / "cache"])
    assert prebuilt.seed_all() == 2 and cache_counts([tmp_path / "cache"]) == before  # nothing copied twice


def test_warmup_prompts_include_one_longer_than_a_prefill_chunk(tmp_path):
    """The warm-up prefills one prompt in two chunks, so that a chunked prefill over a cached prefix is built before
    any timing; it stays within the model's length."""
    session = StubSession()
    session.spec = _spec(tmp_path, [DecodeCell(1, 1024)])
    prompts = session.warmup_prompts()
    chunk = session.prefill_chunk_tokens
    assert [len(p) for p in prompts[:-1]] == [512] * 4 and chunk < len(prompts[-1]) < 2 * chunk
    assert all(2 <= t < session.spec.vocab_size for p in prompts for t in p)
    session.spec.max_model_len = chunk  # a short model: the long prompt is cut to fit with its decoded tokens
    assert len(session.warmup_prompts()[-1]) + 8 < chunk
    # SGLang's EAGLE counts its draft slots against the context too (its validation refused a prompt that fitted
    # without them)
    session.reserved_tokens = 2
    assert len(session.warmup_prompts()[-1]) + 8 + 2 < chunk
    cell = DecodeCell(1, chunk - 20)
    assert cell.context + session.decode_inputs(cell, MeasurePlan())[1] + 2 <= chunk
