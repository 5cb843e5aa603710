"""Random weights with a sane scale for engines that load a model without a checkpoint.

vLLM's and SGLang's ``dummy`` load formats draw every weight from U(-1e-3, 1e-3): activations shrink layer by layer,
the logits are almost flat and MoE routing is decided by the correction bias alone (every token goes to the same
experts). Matrices drawn N(0, 1/fan_in) (or N(0, std)), norm weights 1 and biases 0 keep activations in range, so
attention changes the logits and routing spreads over the experts. Each tensor is seeded by its name, so every
attention backend gets identical weights. Used by ``mla-backend serve-bench --init scaled`` and by tests/e2e.
"""

from __future__ import annotations

import zlib

#: The load format :func:`register_vllm_scaled_loader` registers under by default.
SCALED_LOAD_FORMAT = "mla_scaled_dummy"


def scaled_random_init(model) -> None:
    """vLLM: deterministic (per parameter name) random weights, matrices ~ N(0, 1/fan_in), norm weights 1,
    biases 0. Identical for every attention backend."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not torch.is_floating_point(p):
                continue
            if p.dim() <= 1:
                p.fill_(1.0 if "norm" in name and not name.endswith("bias") else 0.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            w = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.copy_(w * p.shape[-1] ** -0.5)


def register_vllm_scaled_loader(load_format: str = SCALED_LOAD_FORMAT) -> None:
    """Registers ``load_format`` in vLLM: its dummy loader with :func:`scaled_random_init` as the weights.

    The registration lives in the calling process only, so the engine must load the model there
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class ScaledDummyModelLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            scaled_random_init(model)

    register_model_loader(load_format)(ScaledDummyModelLoader)


def patch_sglang_dummy_weights(std: float | None) -> None:
    """SGLang: replaces the ``dummy`` load format's U(-1e-3, 1e-3) init with N(0, std) (``std=None``: N(0, 1/fan_in)),
    deterministic per parameter name. Must run in every scheduler process (where the model loads)."""
    import torch
    from sglang.srt.model_loader import loader

    def initialize_dummy_weights(model, low=-1e-3, high=1e-3, seed=1234):  # noqa: ARG001 - SGLang's signature
        for name, param in model.state_dict().items():
            if not torch.is_floating_point(param) or "cos_sin_cache" in name or "inv_freq" in name:
                continue
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            elif "e_score_correction_bias" in name or name.endswith(".bias"):
                param.data.zero_()
            else:
                gen = torch.Generator(device=param.device)
                gen.manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)
                scale = std if std is not None else (param.shape[-1] ** -0.5 if param.dim() > 1 else 1.0)
                tmp = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, scale,
                                                                                                 generator=gen)
                param.data.copy_(tmp.to(param.dtype))

    loader.initialize_dummy_weights = initialize_dummy_weights
