"""The scaled random weights (random_weights.py) in every vLLM worker process, however the workers start.

vLLM finds a load format in a registry of the process that loads the model. Its tensor-parallel workers may be
spawned, so a registration made in the benchmark's process does not reach them. Every worker imports the class named
in ``worker_extension_cls`` before it loads the model, so naming :class:`ScaledWeights` there runs this module's
registration in each of them. The class adds nothing to the worker.
"""

from __future__ import annotations

from .random_weights import SCALED_LOAD_FORMAT, register_vllm_scaled_loader

register_vllm_scaled_loader()


class ScaledWeights:
    """Named in ``worker_extension_cls``; see the module docstring."""


def engine_kwargs() -> dict:
    """The ``vllm.LLM`` / ``EngineArgs`` arguments that load the scaled random weights in every worker."""
    return {"load_format": SCALED_LOAD_FORMAT, "worker_extension_cls": f"{__name__}.{ScaledWeights.__qualname__}"}
