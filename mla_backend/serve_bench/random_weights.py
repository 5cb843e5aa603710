"""Random weights with a sane scale for engines that load a model without a checkpoint.

vLLM's and SGLang's ``dummy`` load formats draw every weight from U(-1e-3, 1e-3): activations shrink layer by layer,
the logits are almost flat and MoE routing is decided by the correction bias alone (every token goes to the same
experts). Matrices drawn N(0, 1/fan_in) (or N(0, std)), norm weights 1 and biases 0 keep activations in range, so
attention changes the logits and routing spreads over the experts. Each tensor is seeded by its name, so every
attention backend gets identical weights. Used by ``mla-backend serve-bench --init scaled`` and by tests/e2e.

fp8 block-quantised layers (DeepSeek-V3's checkpoint format) hold two tensors per matrix in both engines: ``weight``
(or ``w13_weight`` / ``w2_weight`` for the experts) in float8_e4m3fn, and ``weight_scale_inv`` with one float32 per
128x128 block, the dequantised matrix being ``weight * scale_inv`` block by block (per-tensor fp8 has
``weight_scale`` instead). fp8 cannot hold N(0, 1/fan_in) for a wide layer (1/sqrt(7168) = 0.012 is below e4m3's
smallest normal, 2^-6), so the fp8 tensor gets N(0, 1), where e4m3's three mantissa bits are used, and every block
scale gets the standard deviation: the effective weights are N(0, 1/fan_in) as for a bf16 matrix. These are the
checkpoint's layouts (out x in, experts first), which both engines initialise before they repack anything.

Attention's KV-cache scales (``k_scale``, ``v_scale``, ...) are left as the engine creates them: a value the engine
reads as "not in the checkpoint", which makes it use 1.0 (a zero or random value would scale the fp8 KV cache).
"""

from __future__ import annotations

import zlib

#: The load format :func:`register_vllm_scaled_loader` registers under by default.
SCALED_LOAD_FORMAT = "mla_scaled_dummy"
#: The vLLM worker extension whose import registers :data:`SCALED_LOAD_FORMAT` in each worker process.
VLLM_WORKER_EXTENSION = "mla_backend.serve_bench.vllm_worker_extension.WorkerExtension"
#: Tensors filled this many elements at a time: the float32 draw of a whole expert stack (256 x 4096 x 7168) would
#: need tens of GB beside the weights.
CHUNK_ELEMENTS = 1 << 26
#: Suffixes of a weight's scale tensor, checked in this order (block scales, then per-tensor).
SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: Engine-owned scales left untouched (KV cache and attention quantisation; their "absent" value means 1.0).
ENGINE_OWNED_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale")
#: Buffers that are computed, not loaded (SGLang's state_dict holds them).
COMPUTED_BUFFERS = ("cos_sin_cache", "inv_freq")


def is_fp8(tensor) -> bool:
    """A floating-point tensor of 8 bits (float8_e4m3fn, e4m3fnuz, e5m2): a quantised weight."""
    import torch

    return torch.is_floating_point(tensor) and tensor.element_size() == 1


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def scale_partner(name: str, tensors: dict) -> str | None:
    """The fp8 weight that the scale tensor ``name`` dequantises (``x.weight_scale_inv`` -> ``x.weight``), or None
    when ``name`` is not such a scale."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            partner = name[: -len(suffix)]
            if partner in tensors and is_fp8(tensors[partner]):
                return partner
    return None


def _fill_normal(tensor, std: float, seed: int) -> None:
    """``tensor`` <- N(0, std) in float32, cast to its dtype (fp8 clamped to its range), a chunk of rows at a time,
    so the temporary float32 stays small. Deterministic for a seed and a shape."""
    import torch

    gen = torch.Generator(device=tensor.device).manual_seed(seed)
    flat = tensor.view(-1) if tensor.is_contiguous() else None
    limit = torch.finfo(tensor.dtype).max
    chunks = [tensor] if flat is None else flat.split(CHUNK_ELEMENTS)
    for chunk in chunks:
        values = torch.randn(chunk.shape, generator=gen, device=tensor.device, dtype=torch.float32)
        if std != 1.0:
            values.mul_(std)
        chunk.copy_(values.clamp_(-limit, limit))


def scaled_fill(named_tensors, seed_of, std: float | None = None) -> None:
    """Fills every tensor of ``named_tensors`` (name -> tensor, modified in place):

    * matrices N(0, std), ``std=None``: N(0, 1/fan_in) with fan_in the last dimension (the input features of the
      checkpoint's out x in layout, also for expert stacks);
    * fp8 matrices N(0, 1) and their block or per-tensor scales ``std`` (see the module docstring);
    * static activation scales (``input_scale``) 1; vectors: norm weights 1, biases and router correction biases 0;
    * a tensor that names its own dummy value (newer vLLM's ``dummy_weight_value``, e.g. a norm stored as weight - 1)
      gets that value;
    * engine-owned KV-cache scales, rotary tables and integer tensors untouched; tensors on the meta device (loaded
      later by the engine) too.

    ``seed_of(name)`` gives each tensor's seed. Raises ValueError for an fp8 tensor without a scale beside it (its
    values could not be given a scale)."""
    import torch

    tensors = dict(named_tensors)
    scaled = {scale_partner(name, tensors) for name in tensors} - {None}
    with torch.no_grad():
        for name, tensor in tensors.items():
            leaf = _leaf(name)
            if (not torch.is_floating_point(tensor) or tensor.device.type == "meta"
                    or any(b in name for b in COMPUTED_BUFFERS) or leaf.lstrip("_") in ENGINE_OWNED_SCALES):
                continue
            partner = scale_partner(name, tensors)
            if getattr(tensor, "dummy_weight_value", None) is not None:
                tensor.fill_(tensor.dummy_weight_value)
            elif partner is not None:
                tensor.fill_(std if std is not None else tensors[partner].shape[-1] ** -0.5)
            elif leaf.endswith("input_scale"):
                tensor.fill_(1.0)
            elif is_fp8(tensor):
                if name not in scaled:
                    raise ValueError(f"fp8 tensor {name} {tuple(tensor.shape)} has no {name}_scale_inv or "
                                     f"{name}_scale beside it; cannot give its values a scale")
                _fill_normal(tensor, 1.0, seed_of(name))
            elif tensor.dim() <= 1:
                tensor.fill_(1.0 if "norm" in name and not name.endswith("bias") else 0.0)
            else:
                _fill_normal(tensor, std if std is not None else tensor.shape[-1] ** -0.5, seed_of(name))


def effective_weight(weight, scale, block: tuple[int, int] | None = (128, 128)):
    """The dequantised float32 matrix of an fp8 ``weight`` (``[..., out, in]``) and its ``scale``: one value per
    ``block`` (``weight_scale_inv``) or, with ``block=None``, per tensor. How the engines read the pair; used to check
    :func:`scaled_fill`."""
    import torch

    w = weight.to(torch.float32)
    if block is None:
        return w * scale.to(torch.float32).reshape(-1)[0]
    rows, cols = w.shape[-2:]
    expanded = scale.to(torch.float32).repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w * expanded[..., :rows, :cols]


def scaled_random_init(model) -> None:
    """vLLM: deterministic (per parameter name) random weights, matrices ~ N(0, 1/fan_in), fp8 matrices and their
    scales to the same effective scale, norm weights 1, biases 0. Identical for every attention backend."""
    scaled_fill(model.named_parameters(), lambda name: zlib.crc32(name.encode()))


def register_vllm_scaled_loader(load_format: str = SCALED_LOAD_FORMAT) -> None:
    """Registers ``load_format`` in vLLM: its dummy loader with :func:`scaled_random_init` as the weights.

    The registration lives in the calling process (and the processes forked from it); vllm_worker_extension.py makes
    it in every worker process."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class ScaledDummyModelLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            scaled_random_init(model)

    register_model_loader(load_format)(ScaledDummyModelLoader)


def vllm_worker_kwargs(scaled: bool = True) -> dict:
    """The ``vllm.LLM`` / ``EngineArgs`` arguments that extend every worker, spawned or forked, with
    vllm_worker_extension.py, and with ``scaled`` load the scaled random weights there."""
    kwargs = {"worker_extension_cls": VLLM_WORKER_EXTENSION}
    if scaled:
        kwargs["load_format"] = SCALED_LOAD_FORMAT
    return kwargs


def patch_sglang_dummy_weights(std: float | None) -> None:
    """SGLang: replaces the ``dummy`` load format's U(-1e-3, 1e-3) init with :func:`scaled_fill` (``std=None``:
    N(0, 1/fan_in)), deterministic per parameter name. Must run in every scheduler process (where the model loads)."""
    from sglang.srt.model_loader import loader

    def initialize_dummy_weights(model, low=-1e-3, high=1e-3, seed=1234):  # noqa: ARG001 - SGLang's signature
        scaled_fill(model.state_dict().items(), lambda name: (zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF, std)

    loader.initialize_dummy_weights = initialize_dummy_weights
