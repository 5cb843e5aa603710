"""CPU tests of serve-bench on several GPUs (mla_backend/serve_bench: model_config, weight_memory, parallel,
random_weights, the runners' parallel arguments, the report's setup row).

* the ``deepseek-v3`` model's config equals the released config.json, fp8 block quantisation included;
* the per-GPU weight estimate (fp8 bytes plus block scales, bf16 rest; TP, DP attention, the MTP layer) and the
  layer count chosen to fit, and the driver's clear errors for what cannot run;
* scaled dummy weights on a small module shaped like fp8 block-quantised linear and MoE layers: effective weights
  N(0, 1/fan_in), positive finite scales, KV-cache scales left to the engine;
* the runners' tensor-parallel / DP-attention / MTP / decode-context-parallel arguments accepted by vLLM's own
  ``EngineArgs`` (and its speculative config) and by SGLang's own ``ServerArgs`` (with
  ``PYTHONPATH=.ci/sglang-site``; skipped without it);
* the report's setup row and the dry run.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from mla_backend import cli
from mla_backend.serve_bench import driver, report, sglang_runner, vllm_runner
from mla_backend.serve_bench.model_config import (DEEPSEEK_V3_FP8_QUANTIZATION, deepseek_v3_config, model_config,
                                                  parameter_counts, released_deepseek_v3_config, write_config_dir)
from mla_backend.serve_bench.parallel import GpuInventory, ParallelOptions
from mla_backend.serve_bench.runner_common import measurement
from mla_backend.serve_bench.random_weights import effective_weight, scaled_fill, scaled_random_init
from mla_backend.serve_bench.weight_memory import (ENGINE_RESERVE_BYTES, GIB, ParallelLayout, fit_problem,
                                                   linear_bytes, mlp_bytes, most_layers_that_fit,
                                                   weight_bytes_per_gpu)
from mla_backend.serve_bench.workloads import ThroughputLoad

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
HAS_VLLM = importlib.util.find_spec("vllm") is not None
H100_GIB = 79.6  # what nvidia-smi reports for an H100 80GB HBM3 (81559 MiB)

#: The released deepseek-ai/DeepSeek-V3 config.json, every field the engines read.
RELEASED_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}


def _args(*argv: str):
    return driver.build_parser().parse_args(list(argv))


def _resolve(*argv: str, gpus: GpuInventory = GpuInventory()):
    return driver.resolve(_args(*argv), gpus)


# ----------------------------------------------------------------------------- the released model
def test_deepseek_v3_config_equals_the_released_config_json(tmp_path):
    config = json.loads((write_config_dir(tmp_path, released_deepseek_v3_config(61)) / "config.json").read_text())
    assert {key: config[key] for key in RELEASED_CONFIG} == RELEASED_CONFIG
    assert model_config("deepseek-v3", layers=61) == released_deepseek_v3_config(61)
    assert released_deepseek_v3_config(5)["num_hidden_layers"] == 5
    assert sum(parameter_counts(config).values()) / 1e9 == pytest.approx(671.0, abs=0.5)  # the published 671B
    config["quantization_config"]["weight_block_size"].append(1)  # a copy: the module's constant is untouched
    assert DEEPSEEK_V3_FP8_QUANTIZATION["weight_block_size"] == [128, 128]


def test_small_moe_stays_the_default_and_models_reject_what_they_are_not():
    assert model_config("small-moe") == deepseek_v3_config(16, 8)
    assert "quantization_config" not in model_config("small-moe", 32, 4)
    for bad, message in [(dict(model="deepseek-v3", heads=32, layers=4), "--heads 32 does not apply"),
                         (dict(model="deepseek-v3", layers=None), "needs a layer count"),
                         (dict(model="deepseek-v3", layers=62), "1..61"),
                         (dict(model="llama", layers=4), "unknown model 'llama'")]:
        with pytest.raises(ValueError, match=message):
            model_config(**bad)


# ----------------------------------------------------------------------------- weight bytes per GPU
def test_fp8_linear_takes_one_byte_per_parameter_plus_block_scales():
    assert linear_bytes(4096, 7168, (128, 128)) == 4096 * 7168 + 4 * 32 * 56
    assert linear_bytes(576, 7168, (128, 128)) == 576 * 7168 + 4 * 5 * 56  # a partial last block has a scale too
    assert linear_bytes(4096, 7168, None) == 2 * 4096 * 7168
    config = released_deepseek_v3_config(4)
    assert mlp_bytes(config, 2048, 1) == 3 * 7168 * 2048 + 4 * (32 * 56 + 56 * 16)  # one expert


def test_weight_bytes_per_gpu_follow_the_engines_sharding():
    full = released_deepseek_v3_config(61)
    tp1 = weight_bytes_per_gpu(full, ParallelLayout(1, mtp_layer=True))
    # the released checkpoint is 688.6 GB, of which 3.7 GB are the MTP layer's own copy of embedding and output layer,
    # which the engines share with the target
    assert sum(tp1.values()) / 1e9 == pytest.approx(688.6 - 3.7, abs=1.0)
    assert tp1["embeddings"] == 2 * 2 * 129280 * 7168 + 2 * 7168
    tp4 = weight_bytes_per_gpu(full, ParallelLayout(4))
    assert tp4["mtp"] == 0 and tp4["moe"] == pytest.approx(tp1["moe"] / 4, rel=0.01)
    assert tp1["attention"] / 4 < tp4["attention"] < tp1["attention"] / 3  # q_a / kv_a stay whole on every GPU
    dp = weight_bytes_per_gpu(full, ParallelLayout(4, attention_replicated=True))
    assert dp["attention"] == tp1["attention"] and dp["moe"] == tp4["moe"]  # DP attention: all heads on every GPU
    small = deepseek_v3_config(16, 8)
    # bf16: two bytes per parameter, plus what parameter_counts leaves out: the final norm and the fp32 router biases
    extra = 2 * 7168 + 4 * 16 * (8 - small["first_k_dense_replace"])
    assert sum(weight_bytes_per_gpu(small).values()) == 2 * sum(parameter_counts(small).values()) + extra


def test_the_layer_count_fills_the_gpus_and_an_explicit_one_must_fit():
    memory = int(H100_GIB * GIB)
    # (TP, DP attention, MTP layer) -> layers
    for (tp, dp, mtp), expected in {(2, False, False): 10, (4, False, False): 17, (4, False, True): 16,
                                    (4, True, True): 15, (8, False, False): 33}.items():
        layout = ParallelLayout(tp, dp, mtp)
        layers = most_layers_that_fit(released_deepseek_v3_config, layout, memory, 0.85, 61)
        assert layers == expected
        assert fit_problem(released_deepseek_v3_config(layers), layout, memory, 0.85) is None
        assert fit_problem(released_deepseek_v3_config(min(2 * layers, 61)), layout, memory, 0.85) is not None
    problem = fit_problem(released_deepseek_v3_config(61), ParallelLayout(2), memory, 0.85)
    assert "61 layers at tensor-parallel size 2 need 314.0 GiB of weights per GPU" in problem
    assert f"{ENGINE_RESERVE_BYTES / GIB:.0f} GiB for activations" in problem and "0.85 of 79.6 GiB" in problem
    assert most_layers_that_fit(released_deepseek_v3_config, ParallelLayout(1), 16 * GIB, 0.85, 61) == 0


# ----------------------------------------------------------------------------- the driver's options
def test_driver_builds_the_real_model_with_as_many_layers_as_fit():
    run = _resolve("--engine", "vllm", "--model", "deepseek-v3", "--tensor-parallel-size", "4",
                   "--speculative-tokens", "1", "--kv-cache-dtype", "fp8", gpus=GpuInventory(4, int(H100_GIB * GIB)))
    assert run.model_config["num_hidden_layers"] == 16  # 17 without the MTP layer
    assert run.model_config["quantization_config"] == DEEPSEEK_V3_FP8_QUANTIZATION
    assert run.parallel == ParallelOptions(4, False, 1, 1) and run.parallel.heads_per_gpu(128) == 32
    explicit = _resolve("--engine", "sglang", "--model", "deepseek-v3", "--layers", "6", "--tensor-parallel-size",
                        "4", "--dp-attention", "--gpu-memory-gib", "80")
    assert explicit.model_config["num_hidden_layers"] == 6 and explicit.parallel.heads_per_gpu(128) == 128
    assert explicit.parallel.attention_data_parallel_size == 4
    small = _resolve("--engine", "vllm")
    assert small.model_config == deepseek_v3_config(16, 8) and small.parallel == ParallelOptions()


@pytest.mark.parametrize("argv,message", [
    (("--engine", "vllm", "--tensor-parallel-size", "4"), "--tensor-parallel-size 4 needs 4 GPUs; 2 visible"),
    (("--engine", "vllm", "--tensor-parallel-size", "0"), "--tensor-parallel-size must be at least 1, got 0"),
    (("--engine", "vllm", "--tensor-parallel-size", "2", "--dp-attention"), "--dp-attention is an SGLang option"),
    (("--engine", "sglang", "--dp-attention"), "--dp-attention needs --tensor-parallel-size 2 or more, got 1"),
    (("--engine", "vllm", "--speculative-tokens", "4"), "--speculative-tokens must be 0..3 .* got 4"),
    (("--engine", "vllm", "--tensor-parallel-size", "2", "--decode-context-parallel-size", "3"),
     "--decode-context-parallel-size 3 must divide --tensor-parallel-size 2"),
    (("--engine", "sglang", "--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"),
     "--decode-context-parallel-size is a vLLM option; not supported by sglang"),
    (("--engine", "vllm", "--model", "deepseek-v3", "--heads", "16"), "--heads 16 does not apply to deepseek-v3"),
    (("--engine", "vllm", "--model", "deepseek-v3", "--tensor-parallel-size", "2", "--layers", "61"),
     "61 layers at tensor-parallel size 2 need .* GiB of weights per GPU"),
    (("--engine", "vllm", "--heads", "16", "--tensor-parallel-size", "2", "--layers", "2", "--model", "small-moe",
      "--gpu-memory-gib", "-1"), "--gpu-memory-gib must be positive, got -1"),
])
def test_driver_refuses_what_cannot_run_and_says_why(argv, message):
    with pytest.raises(ValueError, match=message):
        _resolve(*argv, gpus=GpuInventory(2, int(H100_GIB * GIB)))


def test_driver_needs_the_gpu_memory_or_a_layer_count_for_the_real_model():
    with pytest.raises(ValueError, match="without --layers needs the GPU memory .* give --layers or --gpu-memory-gib"):
        _resolve("--engine", "vllm", "--model", "deepseek-v3", "--tensor-parallel-size", "4")
    with pytest.raises(ValueError, match="does not divide the model's 128 heads"):
        _resolve("--engine", "vllm", "--model", "deepseek-v3", "--tensor-parallel-size", "3", "--layers", "4")


def test_engine_spec_carries_the_parallel_options(tmp_path):
    run = _resolve("--engine", "vllm", "--model", "deepseek-v3", "--layers", "4", "--tensor-parallel-size", "4",
                   "--speculative-tokens", "3", "--decode-context-parallel-size", "2")
    spec = driver.engine_spec(run, "CUSTOM", tmp_path, tmp_path, tmp_path / "out", False, time.time() + 60)
    spec.save(tmp_path / "spec.json")
    loaded = type(spec).load(tmp_path / "spec.json")
    assert (loaded.tensor_parallel_size, loaded.dp_attention, loaded.speculative_tokens,
            loaded.decode_context_parallel_size) == (4, False, 3, 2)


# ----------------------------------------------------------------------------- scaled weights, fp8 blocks
class Fp8BlockLayers(torch.nn.Module):
    """Shaped like vLLM's / SGLang's fp8 block-quantised layers before they repack them: a linear layer (``weight``
    out x in in float8_e4m3fn and ``weight_scale_inv`` per 128x128 block, a partial last block as in kv_a_proj's 576
    rows), an expert stack (``w13_weight`` / ``w2_weight`` with their ``*_scale_inv``), a bf16 router, norms, the
    correction bias and an attention layer's KV-cache scale (-1: "not in the checkpoint")."""

    def __init__(self, experts=4, hidden=384, inter=256, rows=576):
        super().__init__()
        fp8, f32 = torch.float8_e4m3fn, torch.float32

        def param(*shape, dtype=f32, value=0.0):
            return torch.nn.Parameter(torch.full(shape, value, dtype=torch.float32).to(dtype), requires_grad=False)

        self.proj = torch.nn.Module()
        self.proj.weight = param(rows, hidden, dtype=fp8)
        self.proj.weight_scale_inv = param(-(-rows // 128), hidden // 128)
        self.experts = torch.nn.Module()
        self.experts.w13_weight = param(experts, 2 * inter, hidden, dtype=fp8)
        self.experts.w13_weight_scale_inv = param(experts, 2 * inter // 128, hidden // 128)
        self.experts.w2_weight = param(experts, hidden, inter, dtype=fp8)
        self.experts.w2_weight_scale_inv = param(experts, hidden // 128, inter // 128)
        self.gate = torch.nn.Module()
        self.gate.weight = param(experts, hidden, dtype=torch.bfloat16)
        self.gate.e_score_correction_bias = param(experts, value=5.0)
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = param(hidden, dtype=torch.bfloat16)
        self.attn = torch.nn.Module()
        self.attn.k_scale = param(value=-1.0)


def _effective_std(weight, scale) -> float:
    return effective_weight(weight, scale).std().item()


def test_scaled_init_gives_fp8_block_layers_the_scale_of_bf16_ones():
    model = Fp8BlockLayers()
    scaled_random_init(model)  # vLLM's path: named_parameters
    scales = [model.proj.weight_scale_inv, model.experts.w13_weight_scale_inv, model.experts.w2_weight_scale_inv]
    assert all(bool(torch.isfinite(s).all() and (s > 0).all()) for s in scales)
    for weight, scale in ((model.proj.weight, model.proj.weight_scale_inv),
                          (model.experts.w13_weight, model.experts.w13_weight_scale_inv),
                          (model.experts.w2_weight, model.experts.w2_weight_scale_inv)):
        fan_in = weight.shape[-1]
        assert weight.dtype == torch.float8_e4m3fn
        assert _effective_std(weight, scale) == pytest.approx(fan_in ** -0.5, rel=0.05)
        assert weight.to(torch.float32).std().item() == pytest.approx(1.0, rel=0.05)  # e4m3's normal range
    assert model.gate.weight.float().std().item() == pytest.approx(384 ** -0.5, rel=0.1)
    assert torch.all(model.gate.e_score_correction_bias == 0) and torch.all(model.input_layernorm.weight == 1)
    assert model.attn.k_scale.item() == -1.0  # the engine reads it as absent and uses 1.0
    offset_norm = torch.nn.Module()
    offset_norm.norm = torch.nn.Module()
    offset_norm.norm.weight = torch.nn.Parameter(torch.full((8,), 3.0), requires_grad=False)
    offset_norm.norm.weight.dummy_weight_value = 0.0  # vLLM's mark for a norm stored as weight - 1
    scaled_random_init(offset_norm)
    assert torch.all(offset_norm.norm.weight == 0)
    experts = model.experts.w13_weight.to(torch.float32)
    assert not torch.equal(experts[0], experts[1])  # every expert its own weights


def test_scaled_init_is_deterministic_and_works_on_state_dicts_with_a_fixed_std():
    a, b = Fp8BlockLayers(), Fp8BlockLayers()
    scaled_random_init(a)
    scaled_random_init(b)
    assert all(torch.equal(x.to(torch.float32), y.to(torch.float32))
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = Fp8BlockLayers()
    scaled_fill(c.state_dict().items(), lambda name: len(name), std=0.02)  # SGLang's path: state_dict, fixed std
    assert _effective_std(c.proj.weight, c.proj.weight_scale_inv) == pytest.approx(0.02, rel=0.05)
    assert torch.all(c.proj.weight_scale_inv == 0.02) and c.attn.k_scale.item() == -1.0


def test_scaled_init_refuses_an_fp8_tensor_without_a_scale():
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(128, 128).to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"fp8 tensor weight \(128, 128\) has no weight_scale_inv"):
        scaled_random_init(model)


def test_scaled_init_fills_large_tensors_in_chunks(monkeypatch):
    from mla_backend.serve_bench import random_weights

    monkeypatch.setattr(random_weights, "CHUNK_ELEMENTS", 1000)
    model = Fp8BlockLayers()
    scaled_random_init(model)
    assert _effective_std(model.experts.w13_weight, model.experts.w13_weight_scale_inv) == pytest.approx(
        384 ** -0.5, rel=0.05)


# ----------------------------------------------------------------------------- the engines' own argument classes
def _spec(engine: str, backend: str, tmp_path: Path, *argv: str):
    run = _resolve("--engine", engine, *argv)
    model_dir = write_config_dir(tmp_path / "model", run.model_config)
    return driver.engine_spec(run, backend, model_dir, tmp_path, tmp_path / "out", in_process=False,
                              hard_deadline=time.time() + 60)


def test_runner_parallel_arguments_without_the_engines(tmp_path):
    spec = _spec("vllm", "CUSTOM", tmp_path, "--tensor-parallel-size", "2", "--speculative-tokens", "1",
                 "--decode-context-parallel-size", "2", "--gpu-memory-gib", "80")
    assert vllm_runner.parallel_kwargs(spec, {"decode_context_parallel_size"}) == {
        "tensor_parallel_size": 2, "decode_context_parallel_size": 2,
        # vLLM's drafter picks its own backend unless told: the MTP layer runs on the backend under test too
        "speculative_config": {"method": "deepseek_mtp", "num_speculative_tokens": 1, "attention_backend": "CUSTOM"}}
    with pytest.raises(ValueError, match="EngineArgs has no decode_context_parallel_size"):
        vllm_runner.parallel_kwargs(spec, {"tensor_parallel_size"})
    spec = _spec("sglang", "tilelang_mla", tmp_path, "--tensor-parallel-size", "4", "--dp-attention",
                 "--speculative-tokens", "3", "--gpu-memory-gib", "80")
    # SGLang's draft worker takes only built-in backends: ours drafts on flashmla, a built-in on itself
    eagle = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4, "speculative_draft_attention_backend": "flashmla"}
    assert sglang_runner.parallel_kwargs(spec, {"attn_dp_size"}) == {"tp_size": 4, "attn_dp_size": 4, **eagle}
    assert sglang_runner.parallel_kwargs(spec, {"enable_dp_attention", "dp_size"}) == {
        "tp_size": 4, "enable_dp_attention": True, "dp_size": 4, **eagle}
    builtin = _spec("sglang", "flashmla", tmp_path, "--speculative-tokens", "1", "--gpu-memory-gib", "80")
    assert "speculative_draft_attention_backend" not in sglang_runner.parallel_kwargs(builtin, set())


def test_sglang_gives_every_attention_replica_a_request(tmp_path):
    # SGLang splits max_running_requests over the DP-attention replicas and refuses to start a replica with none
    spec = _spec("sglang", "tilelang_mla", tmp_path, "--tensor-parallel-size", "2", "--dp-attention",
                 "--workloads", "decode", "--batches", "1", "--gpu-memory-gib", "80")
    kwargs = sglang_runner.server_kwargs(spec, fields=set())
    assert (kwargs["max_running_requests"], kwargs["cuda_graph_max_bs_decode"]) == (2, 1)
    tp_only = _spec("sglang", "tilelang_mla", tmp_path, "--tensor-parallel-size", "2", "--workloads", "decode",
                    "--batches", "1", "--gpu-memory-gib", "80")
    assert sglang_runner.server_kwargs(tp_only, fields=set())["max_running_requests"] == 1
    odd = _spec("sglang", "tilelang_mla", tmp_path, "--tensor-parallel-size", "2", "--dp-attention", "--workloads",
                "decode", "--batches", "3", "--gpu-memory-gib", "80")
    assert sglang_runner.server_kwargs(odd, fields=set())["max_running_requests"] == 4  # 2 per replica, not 1


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs it with .ci/install_vllm.sh)")
def test_vllm_engine_args_accept_tensor_parallel_mtp_and_decode_context_parallel(tmp_path):
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    real = _spec("vllm", "CUSTOM", tmp_path / "real", "--model", "deepseek-v3", "--layers", "4",
                 "--tensor-parallel-size", "4", "--speculative-tokens", "3", "--decode-context-parallel-size", "2",
                 "--kv-cache-dtype", "fp8")
    args = EngineArgs(**vllm_runner.engine_kwargs(real))
    assert args.tensor_parallel_size == 4 and args.decode_context_parallel_size == 2
    assert args.speculative_config == {"method": "deepseek_mtp", "num_speculative_tokens": 3,
                                       "attention_backend": "CUSTOM"}
    assert args.kv_cache_dtype == "fp8" and args.load_format == "dummy"
    # vLLM reads the config and builds the MTP draft from it (the small model: reading fp8 quantisation needs
    # compressed-tensors, which the CPU install of vLLM leaves out)
    small = _spec("vllm", "CUSTOM", tmp_path / "small", "--tensor-parallel-size", "2", "--speculative-tokens", "2",
                  "--decode-context-parallel-size", "2")
    args = EngineArgs(**vllm_runner.engine_kwargs(small))
    model = args.create_model_config()
    assert model.use_mla and model.hf_config.num_nextn_predict_layers == 1
    speculative = args.create_speculative_config(model, ParallelConfig(tensor_parallel_size=2,
                                                                       decode_context_parallel_size=2))
    assert speculative.num_speculative_tokens == 2 and speculative.method in ("deepseek_mtp", "mtp")
    assert speculative.attention_backend.name == "CUSTOM"  # the drafter's backend, as vLLM parses it
    assert speculative.draft_model_config.hf_config.architectures == ["DeepSeekMTPModel"]


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not importable (CI: PYTHONPATH=.ci/sglang-site)")
@pytest.mark.parametrize("dp_attention", [False, True])
def test_sglang_server_args_accept_tensor_parallel_dp_attention_and_eagle(tmp_path, dp_attention):
    from sglang_cpu_env import prepare_cpu_torchvision

    prepare_cpu_torchvision()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from mla_backend.sglang_plugin import register

    register()
    argv = ["--model", "deepseek-v3", "--layers", "4", "--tensor-parallel-size", "4", "--speculative-tokens", "2",
            "--kv-cache-dtype", "fp8"] + (["--dp-attention"] if dp_attention else [])
    spec = _spec("sglang", "tilelang_mla", tmp_path, *argv)
    kwargs = sglang_runner.server_kwargs(spec)
    server_args = ServerArgs(**kwargs)
    assert server_args.tp_size == 4 and server_args.speculative_algorithm == "EAGLE"
    assert (server_args.speculative_num_steps, server_args.speculative_num_draft_tokens) == (2, 3)
    model = ModelConfig.from_server_args(server_args)  # SGLang reads the fp8 config.json
    assert model.num_attention_heads == 128 and model.quantization == "fp8"
    # SGLang's own resolution (speculative and DP-attention checks) needs a device: its CPU one stands in
    resolved = ServerArgs(**{**kwargs, "device": "cpu"})
    resolved.resolve_once()
    assert resolved.tp_size == 4 and resolved.speculative_eagle_topk == 1
    assert resolved.speculative_draft_attention_backend == "flashmla"  # the draft worker takes no out-of-tree backend
    if dp_attention:  # one attention replica per GPU, in either spelling of the installed SGLang
        assert getattr(resolved, "attn_dp_size", None) == 4 or resolved.dp_size == 4
    # the older spelling is accepted too
    old = sglang_runner.server_kwargs(spec, fields=set())
    assert ServerArgs(**old).tp_size == 4


# ----------------------------------------------------------------------------- report and dry run
def test_report_records_the_parallel_setup():
    run = _resolve("--engine", "vllm", "--model", "deepseek-v3", "--layers", "6", "--tensor-parallel-size", "4",
                   "--speculative-tokens", "3", "--decode-context-parallel-size", "2", "--kv-cache-dtype", "fp8",
                   "--workloads", "throughput")
    tput = measurement(ThroughputLoad(), [{"output_tok_per_s": 100.0}])
    env = {"date": "2026-12-01T10:00:00+00:00", "command": "mla-backend serve-bench --engine vllm", "gpu": "H100"}
    data = report.assemble(env, run, {"CUSTOM": {"status": "done", "workloads": [tput]}}, wall_s=1.0)
    s = data["settings"]
    assert (s["gpus"], s["tensor_parallel_size"], s["attention_data_parallel_size"], s["heads_per_gpu"],
            s["speculative_tokens"], s["kv_cache_dtype"], s["decode_context_parallel_size"]) == (4, 4, 1, 32, 3,
                                                                                                 "fp8", 2)
    assert s["model"] == "deepseek-v3" and s["layers"] == 6 and s["heads"] == 128 and s["weight_gib_per_gpu"] == 12.27
    text = report.markdown(data)
    assert "| GPUs | TP | attention DP | heads per GPU | MTP | KV cache | decode CP | weights per GPU |" in text
    assert f"| 4 | 4 | 1 | 32 | 3 draft tokens | fp8 | 2 | {s['weight_gib_per_gpu']} GiB |" in text
    assert "fp8 128x128-block weights" in text and "vocabulary 129280" in text and "with 128 heads, 6 layers" in text


def test_dry_run_lists_the_layout_and_the_weights_per_gpu(capsys):
    assert cli.main(["serve-bench", "--engine", "sglang", "--model", "deepseek-v3", "--tensor-parallel-size", "4",
                     "--dp-attention", "--speculative-tokens", "1", "--gpu-memory-gib", str(H100_GIB),
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model deepseek-v3: DeepSeek-V3 attention with 128 heads, 15 layers" in out
    assert "fp8 blocks 128x128 weights" in out
    assert "GPUs 4: TP 4, attention DP 4, 128 heads per GPU, MTP 1 draft tokens" in out
    assert "GiB per GPU of 67.7 GiB the engine may use" in out
