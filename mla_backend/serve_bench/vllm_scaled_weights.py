"""The scaled random weights (random_weights.py) in every vLLM worker process, however the workers start.

vLLM finds a load format in a registry of the process that loads the model. Its tensor-parallel workers may be
spawned, so a registration made in the benchmark's process does not reach them. Every worker imports the class named
in ``worker_extension_cls`` before it loads the model, so naming :class:`ScaledWeights` there runs this module's
registration in each of them. The class adds nothing to the worker. Import it nowhere else: the import loads
vLLM's model loaders. ``random_weights.vllm_scaled_weights_kwargs`` names it for an engine.
"""

from __future__ import annotations

from .random_weights import register_vllm_scaled_loader

register_vllm_scaled_loader()


class ScaledWeights:
    """Named in ``worker_extension_cls``; see the module docstring."""
