"""Weight bytes each GPU holds for a model config and a parallel layout: how many layers fit, and why a layer count
does not.

The count follows how vLLM and SGLang shard a DeepSeek-V3 model over tensor parallelism (no expert parallelism):

* attention: ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated; ``q_b_proj`` and ``kv_b_proj`` are split by
  output (heads), ``o_proj`` by input (heads). Under SGLang's DP attention every GPU holds the whole attention.
* dense MLP, routed and shared experts: split along the intermediate dimension over all TP ranks.
* router (bf16) and its correction bias (fp32), norms: replicated.
* input embedding split over the attention TP group (replicated under DP attention), output layer over all ranks.
* the MTP layer (speculative decoding): one more decoder layer plus its ``eh_proj`` and norms; it shares the target's
  embedding and output layer.

A linear layer quantised in fp8 blocks (the config's ``quantization_config.weight_block_size``) takes one byte per
parameter plus one float32 scale per block of the rank's shard; everything else is bf16 (two bytes). Rotary tables,
CUDA graphs, activations and the KV cache are not weights: :data:`ENGINE_RESERVE_BYTES` and :data:`AUTO_KV_SHARE`
leave room for them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
BF16_BYTES, FP8_BYTES, BLOCK_SCALE_BYTES, FP32_BYTES = 2, 1, 4, 4
#: Engine memory that is not weights nor KV cache: activations at the largest prefill chunk, CUDA graphs, the
#: sampler's logits, NCCL buffers. An explicit layer count must leave at least this.
ENGINE_RESERVE_BYTES = 6 * GIB
#: Share of the engine's memory that the automatic layer count leaves to the KV cache.
AUTO_KV_SHARE = 0.3


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is spread: ``tensor_parallel`` GPUs; ``attention_replicated``: SGLang's DP attention (each GPU
    runs all heads for its own requests); ``mtp_layer``: the speculative-decoding draft layer is loaded too."""

    tensor_parallel: int = 1
    attention_replicated: bool = False
    mtp_layer: bool = False

    @property
    def attention_tp(self) -> int:
        return 1 if self.attention_replicated else self.tensor_parallel


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def linear_bytes(rows: int, cols: int, block: tuple[int, int] | None) -> int:
    """One rank's shard of a linear layer, ``rows`` outputs by ``cols`` inputs: fp8 plus a float32 scale per
    ``block`` (rows, cols) when block-quantised, else bf16."""
    if block is None:
        return BF16_BYTES * rows * cols
    return FP8_BYTES * rows * cols + BLOCK_SCALE_BYTES * _ceil_div(rows, block[0]) * _ceil_div(cols, block[1])


def fp8_block(config: dict) -> tuple[int, int] | None:
    """The fp8 block shape of the config's ``quantization_config``, or None for bf16 weights."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or "weight_block_size" not in quant:
        raise ValueError(f"only fp8 block quantisation is counted, got quantization_config {quant}")
    rows, cols = quant["weight_block_size"]
    return rows, cols


def attention_layer_bytes(config: dict, layout: ParallelLayout) -> int:
    h, heads, tp = config["hidden_size"], config["num_attention_heads"], layout.attention_tp
    q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    block = fp8_block(config)
    heads_here = _ceil_div(heads, tp)
    linears = (linear_bytes(q_lora + kv_lora + rope, h, block)  # q_a_proj and kv_a_proj_with_mqa, replicated
               + linear_bytes(heads_here * (nope + rope), q_lora, block)  # q_b_proj
               + linear_bytes(heads_here * (nope + v), kv_lora, block)  # kv_b_proj
               + linear_bytes(h, heads_here * v, block))  # o_proj
    norms = BF16_BYTES * (q_lora + kv_lora + 2 * h)  # q_a, kv_a, input and post-attention layernorms
    return linears + norms


def mlp_bytes(config: dict, intermediate: int, tensor_parallel: int) -> int:
    """A gated MLP (gate and up fused, then down) split over ``tensor_parallel`` ranks."""
    h, block = config["hidden_size"], fp8_block(config)
    part = _ceil_div(intermediate, tensor_parallel)
    return linear_bytes(2 * part, h, block) + linear_bytes(h, part, block)


def moe_bytes(config: dict, layout: ParallelLayout) -> int:
    h, experts = config["hidden_size"], config["n_routed_experts"]
    tp, width = layout.tensor_parallel, config["moe_intermediate_size"]
    routed = experts * mlp_bytes(config, width, tp)
    shared = mlp_bytes(config, config["n_shared_experts"] * width, tp)
    router = BF16_BYTES * experts * h + FP32_BYTES * experts  # gate weight and the correction bias
    return routed + shared + router


def weight_bytes_per_gpu(config: dict, layout: ParallelLayout = ParallelLayout()) -> dict[str, int]:
    """Weight bytes one GPU holds, by part (the MTP layer only where ``layout.mtp_layer``)."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    dense_layers = min(config["first_k_dense_replace"], layers)
    attention = attention_layer_bytes(config, layout)
    moe_layer = moe_bytes(config, layout)
    parts = {
        "attention": attention * layers,
        "dense_mlp": mlp_bytes(config, config["intermediate_size"], layout.tensor_parallel) * dense_layers,
        "moe": moe_layer * (layers - dense_layers),
        "embeddings": BF16_BYTES * vocab * h * (1 / layout.attention_tp + 1 / layout.tensor_parallel) + BF16_BYTES * h,
        "mtp": 0,
    }
    if layout.mtp_layer:  # a MoE decoder layer plus eh_proj (bf16 in both engines) and three norms
        parts["mtp"] = attention + moe_layer + BF16_BYTES * (2 * h * h + 3 * h)
    return {name: int(value) for name, value in parts.items()}


def engine_budget_bytes(gpu_memory_bytes: int, gpu_memory_fraction: float) -> int:
    """What the engine may use of one GPU (vLLM gpu_memory_utilization / SGLang mem_fraction_static)."""
    return int(gpu_memory_bytes * gpu_memory_fraction)


def fit_problem(config: dict, layout: ParallelLayout, gpu_memory_bytes: int, gpu_memory_fraction: float) -> str | None:
    """Why the weights do not fit on each GPU with room for the engine's activations, or None when they do."""
    weights = sum(weight_bytes_per_gpu(config, layout).values())
    budget = engine_budget_bytes(gpu_memory_bytes, gpu_memory_fraction)
    if weights + ENGINE_RESERVE_BYTES <= budget:
        return None
    return (f"{config['num_hidden_layers']} layers at tensor-parallel size {layout.tensor_parallel}"
            f"{' with DP attention' if layout.attention_replicated else ''}"
            f"{' and the MTP layer' if layout.mtp_layer else ''} need {weights / GIB:.1f} GiB of weights per GPU, "
            f"plus {ENGINE_RESERVE_BYTES / GIB:.0f} GiB for activations; the engine may use {budget / GIB:.1f} GiB "
            f"({gpu_memory_fraction} of {gpu_memory_bytes / GIB:.1f} GiB): use fewer --layers or a larger "
            "--tensor-parallel-size")


def most_layers_that_fit(config_for_layers, layout: ParallelLayout, gpu_memory_bytes: int,
                         gpu_memory_fraction: float, max_layers: int) -> int:
    """The most layers (up to ``max_layers``) whose weights leave :data:`AUTO_KV_SHARE` of the engine's memory to
    the KV cache; 0 when not even one does. ``config_for_layers(n)`` builds the config with ``n`` layers."""
    budget = engine_budget_bytes(gpu_memory_bytes, gpu_memory_fraction)
    room = budget * (1 - AUTO_KV_SHARE) - ENGINE_RESERVE_BYTES
    best = 0
    for layers in range(1, max_layers + 1):  # weights grow with layers: stop at the first that does not fit
        if sum(weight_bytes_per_gpu(config_for_layers(layers), layout).values()) > room:
            break
        best = layers
    return best


def layout_problem(config: dict, layout: ParallelLayout) -> str | None:
    """Why the engines cannot shard ``config`` this way, or None: heads over the attention TP group, and for fp8
    blocks, each rank's share of the MoE and dense intermediate dimensions in whole blocks."""
    tp, heads = layout.tensor_parallel, config["num_attention_heads"]
    if tp < 1:
        return f"--tensor-parallel-size must be at least 1, got {tp}"
    if heads % layout.attention_tp:
        return (f"--tensor-parallel-size {tp} does not divide the model's {heads} heads; supported: a divisor of "
                f"{heads}, or DP attention")
    block = fp8_block(config)
    if block:
        for key in ("moe_intermediate_size", "intermediate_size"):
            if config[key] % tp or (config[key] // tp) % block[0]:
                return (f"--tensor-parallel-size {tp} splits {key} {config[key]} into shards that are not whole "
                        f"fp8 blocks of {block[0]}; supported: a size whose shard is a multiple of {block[0]}")
    return None
