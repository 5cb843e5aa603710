"""CPU tests of serve-bench's teacher-forced agreement check (``--workloads forced``).

* the workload: sizing, prompts (ragged, the same for every backend), its place in the run;
* the verdict (agreement.py) on synthetic argmax records: ours read against the built-ins' agreement with each other;
* vLLM's forcing processor loaded by name through vLLM's own loader and applied to logits (vLLM's SamplingParams);
* SGLang's forcing processor on SGLang's own ``CustomLogitProcessor`` (with ``PYTHONPATH=.ci/sglang-site``; skipped
  without it), and the argmax it records read back.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from mla_backend.serve_bench import agreement, sglang_runner, vllm_runner
from mla_backend.serve_bench.runner_common import EngineSession, EngineSpec, forced_record
from mla_backend.serve_bench.workloads import (DecodeCell, ForcedDecode, MeasurePlan, build_workloads,
                                               kv_tokens_needed, longest_request, most_requests, workload_from_dict,
                                               workload_to_dict)

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _spec(tmp_path, engine="vllm", workloads=(ForcedDecode(),)) -> EngineSpec:
    return EngineSpec(engine=engine, backend="X", model_dir=str(tmp_path), vocab_size=32000,
                      result_path=str(tmp_path / "result.json"), log_path=str(tmp_path / "engine.log"),
                      profile_dir=str(tmp_path), workloads=[workload_to_dict(w) for w in workloads])


# ----------------------------------------------------------------------------- the workload
def test_forced_runs_only_on_request_and_first():
    assert all(w.kind != "forced" for w in build_workloads())
    workloads = build_workloads(("decode", "forced"), batches=(4,), contexts=(2048,))
    assert workloads == [ForcedDecode(), DecodeCell(4, 2048)]
    load = ForcedDecode(prompts=8, context=512, steps=16)
    assert workload_from_dict(workload_to_dict(load)) == load and load.name == "forced 8x512/16"
    assert kv_tokens_needed(load, MeasurePlan()) == 8 * (512 + 16)
    assert longest_request(load, MeasurePlan()) == 528 and most_requests(load) == 8


def test_forced_inputs_are_ragged_and_the_same_for_every_backend(tmp_path):
    load, plan = ForcedDecode(prompts=6, context=600, steps=10), MeasurePlan(seed=3)
    prompts, scripts = EngineSession.forced_inputs(type("S", (), {"spec": _spec(tmp_path)})(), load, plan)
    again = EngineSession.forced_inputs(type("S", (), {"spec": _spec(tmp_path, "sglang")})(), load, plan)
    assert (prompts, scripts) == again
    assert [len(p) for p in prompts] == [100, 200, 300, 400, 500, 600]
    assert len(scripts) == 6 and all(len(s) == 10 and min(s) >= 2 and max(s) < 32000 for s in scripts)
    assert prompts[1] != prompts[5][:200]  # requests do not share a prefix
    assert scripts[0] != scripts[1]


def test_a_forcing_that_did_not_hold_is_an_error_not_data():
    good = forced_record(ForcedDecode(), [[1, 2]], True)
    bad = forced_record(ForcedDecode(), [[1, 2]], False)
    assert good["status"] == "ok" and bad["status"] == "error" and "did not hold" in bad["error"]


# ----------------------------------------------------------------------------- the verdict
def _run(argmax_by_backend: dict, ours="CUSTOM") -> dict:
    load = ForcedDecode(prompts=len(next(iter(argmax_by_backend.values()))), steps=40)
    backends = {b: {"backend": b, "status": "done", "workloads": [forced_record(load, a, True)]}
                for b, a in argmax_by_backend.items()}
    return {"settings": {"ours": ours, "workloads": [load.name], "workload_kinds": {load.name: "forced"}},
            "backends": backends}


def _truth(requests: int, steps: int = 40) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000) for _ in range(steps)] for _ in range(requests)]


def _noisy(base, flip: float, seed: int):
    rng = random.Random(seed)
    return [[t if rng.random() >= flip else t + 1 for t in row] for row in base]


def _verdict_with_ours_flipping(flip: float) -> tuple[dict, str]:
    """Ours and two built-ins, each the same sequences with a share of steps changed (the built-ins 5%)."""
    truth = _truth(32)
    data = _run({"CUSTOM": _noisy(truth, flip, 1), "FLASHMLA": _noisy(truth, 0.05, 2),
                 "FLASH_ATTN_MLA": _noisy(truth, 0.05, 3)})
    return next(iter(agreement.compare(data).values())), "\n".join(agreement.markdown(data))


def test_ours_passes_when_it_agrees_with_the_built_ins_as_they_agree_with_each_other():
    verdict, table = _verdict_with_ours_flipping(0.05)
    assert verdict["passed"] is True and len(verdict["pairs"]) == 3
    assert 0.85 < verdict["ours_median"] < 0.95 and 0.85 < verdict["built_in_median"] < 0.95
    assert "**PASS**" in table


def test_ours_fails_when_it_agrees_less_than_the_built_ins_do():
    verdict, table = _verdict_with_ours_flipping(0.4)
    assert verdict["passed"] is False and verdict["ours_median"] < verdict["built_in_median"] - verdict["allowed"]
    assert "**FAIL**" in table


def test_a_verdict_on_built_ins_that_rarely_agree_is_marked_weak():
    """Built-ins that agree on few steps (random weights at full width) still give a verdict, marked weak."""
    truth = _truth(32)
    # Each keeps 40% of the steps and draws the rest from its own tokens: about 16% agreement per pair.
    data = _run({b: [[t if rng.random() < 0.4 else -rng.randrange(1, 1000) for t in row] for row in truth]
                 for b, rng in (("CUSTOM", random.Random(1)), ("FLASHMLA", random.Random(2)),
                                ("FLASH_ATTN_MLA", random.Random(3)))})
    verdict = next(iter(agreement.compare(data).values()))
    assert verdict["built_in_median"] < agreement.WEAK_BELOW and verdict["weak"] is True
    assert "Weak verdict" in "\n".join(agreement.markdown(data))
    strong, table = _verdict_with_ours_flipping(0.05)
    assert strong["weak"] is False and "Weak verdict" not in table


def test_no_verdict_without_two_built_ins():
    truth = _truth(8)
    data = _run({"CUSTOM": truth, "FLASHMLA": truth})
    verdict = next(iter(agreement.compare(data).values()))
    assert verdict["passed"] is None and verdict["pairs"][0]["fraction"] == 1.0
    assert "No verdict" in "\n".join(agreement.markdown(data))


# ----------------------------------------------------------------------------- the engines' forcing
@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_vllm_loads_the_forcing_processor_by_name_and_it_forces_the_script(tmp_path):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessor, _load_logitsprocs_by_fqcns

    from mla_backend.serve_bench.vllm_forcing import FORCE_TOKENS, ForceTokens

    kwargs = vllm_runner.engine_kwargs(_spec(tmp_path))
    assert kwargs["logits_processors"] == [FORCE_TOKENS]
    assert "logits_processors" not in vllm_runner.engine_kwargs(_spec(tmp_path, workloads=(DecodeCell(1, 1024),)))
    (loaded,) = _load_logitsprocs_by_fqcns([FORCE_TOKENS])
    assert loaded is ForceTokens and issubclass(loaded, LogitsProcessor)
    # driven through vLLM's own batch-update bookkeeping: a request with a script emits it whatever the logits, one
    # without is untouched
    from vllm.v1.sample.logits_processor import BatchUpdate

    processor = ForceTokens(None, torch.device("cpu"), False)
    assert not processor.is_argmax_invariant()
    forced, out0, out1 = [5, 7, 9], [], []
    processor.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args={"force_tokens": forced}), [1, 2], out0), (1, SamplingParams(), [3], out1)]))
    for step in range(3):
        logits = torch.randn(2, 12)
        free_choice = int(logits[1].argmax())
        result = processor.apply(logits)
        assert int(result[0].argmax()) == forced[step] and torch.isinf(result[0]).sum() == 11
        assert int(result[1].argmax()) == free_choice
        out0.append(int(result[0].argmax()))
        out1.append(free_choice)


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not importable (CI: PYTHONPATH=.ci/sglang-site)")
def test_sglang_forcing_processor_records_the_models_argmax_and_forces_the_script(tmp_path):
    from sglang_cpu_env import prepare_cpu_torchvision

    prepare_cpu_torchvision()  # before the first sglang import (a CPU-only torch beside PyPI's torchvision)
    assert sglang_runner.server_kwargs(_spec(tmp_path, "sglang"), fields=set())["enable_custom_logit_processor"]
    processor_class = sglang_runner.forced_tokens_processor()
    processor = processor_class.from_str(processor_class().to_str())  # as SGLang ships it to its schedulers

    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def admit(req, end):
        """What SGLang's prefill adder records of a request's round: the prompt filled up to ``end``."""
        if hasattr(req, "set_extend_range"):  # SGLang 0.5.17
            req.set_extend_range(0, end)
        else:  # 0.5.23
            req.extend_end = end

    # request 0 prefills in two chunks; request 1 in one, and the overlap scheduler runs it once more after its last
    # step
    requests = [Req(f"r{i}", "", array("q", range(n)), SamplingParams(max_new_tokens=3)) for i, n in enumerate((6, 3))]
    admit(requests[0], 4)
    admit(requests[1], 3)
    params = [{"__req__": requests[i], "forced": [3, 4, 5], "record_dir": str(tmp_path), "index": i}
              for i in range(2)]
    own = [[], []]
    for call in range(5):
        rows = [i for i in (0, 1) if not (i == 0 and call == 4) and not (i == 1 and call == 0)]
        logits = torch.randn(len(rows), 16)
        out = processor(logits.clone(), [params[i] for i in rows])
        for row, i in enumerate(rows):
            req = requests[i]
            if i == 0 and call == 0:  # the middle chunk: its row is left alone, its token dropped
                assert torch.equal(out[row], logits[row])
                admit(req, 6)
                continue
            if len(req.output_ids) < 3:
                own[i].append(int(logits[row].argmax()))
            step = min(len(req.output_ids), 2)
            assert int(out[row].argmax()) == [3, 4, 5][step] and torch.isinf(out[row]).sum() == 15
            req.output_ids.append(int(out[row].argmax()))
    assert [list(r.output_ids[:3]) for r in requests] == [[3, 4, 5], [3, 4, 5]]
    assert sglang_runner.read_forced_argmax(str(tmp_path), 2) == own
