"""DeepSeek-V3-shaped models for the served-speed benchmark, as Hugging Face config directories (no weights).

Two models (``--model``):

* ``small-moe`` (the default, one GPU): DeepSeek-V3's attention, width for width (hidden 7168, q_lora 1536, kv_lora
  512, qk_nope 128, qk_rope 64, v_head 128, yarn rope as in the released ``config.json``); only the number of heads
  changes, to what one tensor-parallel rank holds (128 heads at TP1, 32 at TP4, 16 at TP8). Everything else is shrunk
  so one GPU holds the model and attention stays a visible share of a decode step: few layers, a small MoE (16
  experts of intermediate 512, top 4, in DeepSeek's grouped routing), a 32k vocabulary and bf16 weights.
* ``deepseek-v3`` (several GPUs): the released model at its real shapes, 128 heads, 256 routed experts of
  intermediate 2048 (top 8), the 129280-token vocabulary and the released checkpoint's fp8 block quantisation; only
  the number of layers is chosen, as many as the GPUs hold (weight_memory.py says how many).

Engines load either with dummy weights (``load_format="dummy"`` or random_weights.py), so nothing but
``config.json`` is written.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

from ..constants import KV_LORA_RANK, MAX_HEADS, ROPE_DIM

CONFIG_NAME = "config.json"
HEAD_CHOICES_DOC = "16 (TP8 rank), 32 (TP4 rank) or 128 (TP1)"

#: DeepSeek-V3's attention and position settings, from its released config.json.
DEEPSEEK_V3_ATTENTION = {
    "hidden_size": 7168,
    "q_lora_rank": 1536,
    "kv_lora_rank": KV_LORA_RANK,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": ROPE_DIM,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_interleave": True,
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "attention_dropout": 0.0,
}

#: DeepSeek-V3's routing scheme, shared by both MoE sizes: sigmoid scores, grouped top-k with a correction bias.
DEEPSEEK_ROUTING = {
    "moe_layer_freq": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "ep_size": 1,
}

#: The shrunk rest: DeepSeek-V3's routing scheme (sigmoid scores, grouped top-k with a correction bias, one shared
#: expert, the first layer dense) at 1/16 of its experts and 1/4 of their width.
SMALL_MOE = {
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 512,
    "intermediate_size": 2048,  # the dense first layer's MLP
    "first_k_dense_replace": 1,
    **DEEPSEEK_ROUTING,
}

# A 32k vocabulary instead of DeepSeek's 129280: with only a few layers, a full-size output layer would be a large
# share of every decode step, which a 61-layer model does not have.
VOCAB_SIZE = 32000


SMALL_MOE_MODEL, DEEPSEEK_V3_MODEL = "small-moe", "deepseek-v3"
MODEL_CHOICES = (SMALL_MOE_MODEL, DEEPSEEK_V3_MODEL)
DEFAULT_MODEL = SMALL_MOE_MODEL
SMALL_MOE_DEFAULT_HEADS, SMALL_MOE_DEFAULT_LAYERS = 16, 8

#: The released DeepSeek-V3's MoE, vocabulary and depth (its config.json).
DEEPSEEK_V3_MOE = {
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,  # the dense first layers' MLP
    "first_k_dense_replace": 3,
    **DEEPSEEK_ROUTING,
}
DEEPSEEK_V3_HEADS = 128
DEEPSEEK_V3_LAYERS = 61
DEEPSEEK_V3_VOCAB_SIZE = 129280
#: The released checkpoint's weight format: every linear layer of attention, the dense MLPs and the experts in fp8
#: (e4m3) with one float32 scale per 128x128 block (``weight_scale_inv``); embeddings, output layer, norms and the
#: router stay bf16. Engines build the same layers from this entry, so dummy weights take the checkpoint's memory.
DEEPSEEK_V3_FP8_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def deepseek_v3_config(heads: int = 16, layers: int = 8, vocab_size: int = VOCAB_SIZE, **overrides) -> dict:
    """The config.json contents: DeepSeek-V3's attention with ``heads`` query heads, ``layers`` decoder layers and
    the small MoE; ``overrides`` replace any field (e.g. ``n_routed_experts``)."""
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"heads must be 1..{MAX_HEADS} (DeepSeek-V3 has 128: {HEAD_CHOICES_DOC}), got {heads}")
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        **DEEPSEEK_V3_ATTENTION,
        **SMALL_MOE,
        # the MTP layer is part of the released config; engines build it only for speculative decoding
        "num_nextn_predict_layers": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    config.update(overrides)
    return config


def released_deepseek_v3_config(layers: int) -> dict:
    """The released DeepSeek-V3 (128 heads, 256 experts, fp8 block-quantised weights) with ``layers`` decoder
    layers (61 in the release; the first three have a dense MLP, the rest the MoE)."""
    if not 1 <= layers <= DEEPSEEK_V3_LAYERS:
        raise ValueError(f"layers must be 1..{DEEPSEEK_V3_LAYERS} for {DEEPSEEK_V3_MODEL} (the released model has "
                         f"{DEEPSEEK_V3_LAYERS}), got {layers}")
    return deepseek_v3_config(DEEPSEEK_V3_HEADS, layers, vocab_size=DEEPSEEK_V3_VOCAB_SIZE, **DEEPSEEK_V3_MOE,
                              quantization_config=copy.deepcopy(DEEPSEEK_V3_FP8_QUANTIZATION))


def model_config(model: str, heads: int | None = None, layers: int | None = None) -> dict:
    """The config of ``model`` (one of :data:`MODEL_CHOICES`). ``small-moe`` takes any head count (default 16) and
    layer count (default 8); ``deepseek-v3`` has its 128 heads and needs ``layers``."""
    if model == SMALL_MOE_MODEL:
        return deepseek_v3_config(SMALL_MOE_DEFAULT_HEADS if heads is None else heads,
                                  SMALL_MOE_DEFAULT_LAYERS if layers is None else layers)
    if model == DEEPSEEK_V3_MODEL:
        if heads is not None and heads != DEEPSEEK_V3_HEADS:
            raise ValueError(f"--heads {heads} does not apply to {DEEPSEEK_V3_MODEL}, which has "
                             f"{DEEPSEEK_V3_HEADS} heads (tensor parallelism splits them over the GPUs)")
        if layers is None:
            raise ValueError(f"{DEEPSEEK_V3_MODEL} needs a layer count (1..{DEEPSEEK_V3_LAYERS})")
        return released_deepseek_v3_config(layers)
    raise ValueError(f"unknown model {model!r}; supported: {', '.join(MODEL_CHOICES)}")


def write_config_dir(directory: str | Path, config: dict) -> Path:
    """Writes ``config`` as ``directory/config.json`` (creating the directory) and returns the directory."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return path


def shared_config_dir(config: dict, fallback: str | Path) -> Path:
    """A directory holding ``config`` as ``config.json``, named by its contents, under the user's cache
    (``$XDG_CACHE_HOME`` or ``~/.cache``, then ``mla_backend/models/<sha256[:16]>``); ``fallback`` where that cannot be
    written.

    vLLM keys its torch.compile cache by the model's path as well as its config, so one path per config lets every
    run of that config on a machine, whatever its ``--out-dir``, load the graphs the first one compiled (a cold
    compile of a 10-layer DeepSeek-V3 with MTP takes minutes per engine start).
    """
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = cache / "mla_backend" / "models" / hashlib.sha256(text.encode()).hexdigest()[:16]
    path = directory / CONFIG_NAME
    try:
        if not path.is_file() or path.read_text() != text:
            directory.mkdir(parents=True, exist_ok=True)
            partial = directory / f".{CONFIG_NAME}.{os.getpid()}"  # another run may write the same file: replace whole
            partial.write_text(text)
            os.replace(partial, path)
        return directory
    except OSError:
        return write_config_dir(fallback, config)


def write_model_dir(directory: str | Path, heads: int = 16, layers: int = 8, **overrides) -> Path:
    """Writes the small-MoE model's ``directory/config.json`` (creating the directory) and returns the directory."""
    return write_config_dir(directory, deepseek_v3_config(heads, layers, **overrides))


def kv_bytes_per_token(config: dict, kv_cache_dtype: str = "auto") -> int:
    """KV-cache bytes one token takes over all layers: one 576-wide latent row per layer (fp8: one byte each)."""
    row = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    return config["num_hidden_layers"] * row * (1 if kv_cache_dtype.startswith("fp8") else 2)


def parameter_counts(config: dict) -> dict[str, int]:
    """Parameters by part, whole model (the MTP layer, which runs only under speculative decoding, is left out)."""
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    attention = (h * q_lora + q_lora * heads * qk_head + h * (kv_lora + rope)
                 + kv_lora * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
                 + heads * config["v_head_dim"] * h + q_lora + kv_lora + 2 * h)  # + the three norms
    dense_layers = min(config["first_k_dense_replace"], layers)
    expert = 3 * h * config["moe_intermediate_size"]
    moe = (config["n_routed_experts"] + config["n_shared_experts"]) * expert + h * config["n_routed_experts"]
    return {
        "attention": attention * layers,
        "dense_mlp": 3 * h * config["intermediate_size"] * dense_layers,
        "moe": moe * (layers - dense_layers),
        "embeddings": 2 * config["vocab_size"] * h,  # input embedding and output layer (untied)
    }
