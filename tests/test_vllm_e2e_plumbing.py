"""CPU tests of tests/e2e/vllm_e2e.py's plumbing (the GPU end-to-end script) against the real vllm package: its
engine arguments are valid ``EngineArgs``, its comparison and prompts, its scaled-weight loader as vLLM registers it,
and the order in which its engine process turns the fp32 check on. The script itself needs a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")

E2E_SCRIPT = Path(__file__).resolve().parent / "e2e" / "vllm_e2e.py"


def _e2e_module():
    spec = importlib.util.spec_from_file_location("vllm_e2e", E2E_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_engine_arguments_are_valid_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    e2e = _e2e_module()
    for name, (_, *engines) in e2e.CASES.items():
        for eng in engines:
            spec = dict(model_dir=str(e2e.CONFIG.parent), init="scaled", gpu_mem=0.5, max_model_len=4096,
                        max_num_seqs=32, max_tokens=32, prompts=[[2]], **eng)
            args = EngineArgs(**e2e.engine_kwargs(spec, spec["model_dir"]))  # LLM(**kwargs) builds exactly this
            assert args.attention_backend == eng["backend"] and args.block_size == eng["block_size"], name
            if eng.get("num_spec"):
                assert args.speculative_config["method"] == "mtp"
                assert args.speculative_config["attention_backend"] == eng["backend"]


def test_e2e_comparison_and_prompts():
    e2e = _e2e_module()
    prompts = e2e.make_prompts([1, 7, 63], 32000, seed=0)
    assert [len(p) for p in prompts] == [1, 7, 63] and all(2 <= t < 32000 for p in prompts for t in p)
    assert prompts == e2e.make_prompts([1, 7, 63], 32000, seed=0)
    a = [list(range(32)), list(range(32)), list(range(32))]
    b = [list(range(32)), list(range(10)) + [99] * 22, [99] + list(range(1, 32))]
    got = e2e.compare(a, b, [1, 7, 63])
    assert [r["first_divergence"] for r in got["rows"]] == [None, 10, 0]
    assert [r["first8_equal"] for r in got["rows"]] == [True, True, False]
    assert got["token_match"] == round((32 + 10 + 31) / 96, 4) and not got["passed"]
    assert e2e.compare(a, a, [1, 7, 63])["passed"]


def test_e2e_scaled_loader_registers_with_vllm():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    e2e = _e2e_module()
    e2e.register_scaled_loader()
    loader = get_model_loader(LoadConfig(load_format=e2e.SCALED_LOAD_FORMAT))

    class Tiny(torch.nn.Module):  # DeepSeek's norms all have "norm" in their names
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 32)
            self.input_layernorm = torch.nn.LayerNorm(32)

    model = Tiny()
    loader.load_weights(model, None)
    weight = model.proj.weight
    assert abs(weight.std().item() - 64 ** -0.5) < 0.03 and model.proj.bias.eq(0).all()
    assert model.input_layernorm.weight.eq(1).all() and model.input_layernorm.bias.eq(0).all()
    again = Tiny()
    loader.load_weights(again, None)
    assert torch.equal(again.proj.weight, weight)  # deterministic per parameter name


def test_e2e_engine_sets_verify_before_it_imports_the_package():
    # mla_backend.verify reads MLA_BACKEND_VERIFY once, at import: set after the first import, nothing is checked
    import inspect

    lines = inspect.getsource(_e2e_module().engine_main).splitlines()
    sets = next(i for i, line in enumerate(lines) if 'os.environ["MLA_BACKEND_VERIFY"]' in line)
    imports = [i for i, line in enumerate(lines) if "import" in line and "mla_backend" in line.split("#")[0]]
    assert imports and sets < min(imports)
