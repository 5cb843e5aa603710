"""serve-bench on several GPUs: the parallel options, the GPUs this machine has, and the model that fits them.

* ``--tensor-parallel-size N``: vLLM ``tensor_parallel_size``, SGLang ``tp_size``. Attention heads are split over
  the N GPUs (128 heads at TP4: 32 per GPU), as are the dense MLP and the experts.
* ``--dp-attention`` (SGLang): attention data-parallel over the N GPUs: each GPU keeps all heads for its own share of
  the requests; the MoE stays tensor-parallel.
* ``--speculative-tokens K``: DeepSeek's MTP layer drafts K tokens per step and the target verifies K + 1 queries
  per request (vLLM ``deepseek_mtp``, SGLang ``EAGLE``). Our op takes up to 4 queries per request, so K <= 3.
* ``--decode-context-parallel-size N`` (vLLM, where its EngineArgs has the field): the KV cache of each request is
  spread over N of the TP GPUs during decode.

``resolve_model`` builds the model config and checks that its weights fit each GPU (weight_memory.py); with
``deepseek-v3`` and no ``--layers`` it takes as many layers as fit.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from .model_config import (DEEPSEEK_V3_LAYERS, DEEPSEEK_V3_MODEL, model_config, released_deepseek_v3_config)
from .weight_memory import GIB, ParallelLayout, fit_problem, layout_problem, most_layers_that_fit

#: Our op verifies up to 4 queries per request: the token and 3 drafts.
MAX_SPECULATIVE_TOKENS = 3


@dataclass(frozen=True)
class GpuInventory:
    """GPUs this process may use and the memory of each (None: unknown, e.g. no GPU or no nvidia-smi)."""

    count: int | None = None
    memory_bytes: int | None = None


def _visible_count(total: int) -> int:
    """nvidia-smi lists every GPU; CUDA_VISIBLE_DEVICES may hide some from the engines."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return total
    return min(total, len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]))


def detect_gpus() -> GpuInventory:
    """The GPUs from nvidia-smi, which (unlike torch) creates no CUDA context in this process; the smallest memory
    counts, since every rank holds the same share."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        mib = [int(float(line.strip())) for line in out.splitlines() if line.strip()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return GpuInventory()
    if not mib:
        return GpuInventory()
    return GpuInventory(_visible_count(len(mib)), min(mib) * 2**20)


@dataclass(frozen=True)
class ParallelOptions:
    """The command line's parallel settings, as given."""

    tensor_parallel_size: int = 1
    dp_attention: bool = False
    speculative_tokens: int = 0
    decode_context_parallel_size: int = 1

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tensor_parallel_size, self.dp_attention, self.speculative_tokens > 0)

    @property
    def attention_data_parallel_size(self) -> int:
        """Attention replicas each serving their own requests (SGLang's dp_size under DP attention)."""
        return self.tensor_parallel_size if self.dp_attention else 1

    def heads_per_gpu(self, heads: int) -> int:
        """Query heads each GPU's attention runs: split over TP, all of them under DP attention."""
        return heads if self.dp_attention else heads // self.tensor_parallel_size


def check_parallel_options(engine: str, options: ParallelOptions, gpus: GpuInventory) -> None:
    """ValueError naming the option, the value and what is supported."""
    tp = options.tensor_parallel_size
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
    if gpus.count is not None and tp > gpus.count:
        raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {gpus.count} visible")
    if options.dp_attention:
        if engine != "sglang":
            raise ValueError(f"--dp-attention is an SGLang option (enable_dp_attention); not supported by {engine}")
        if tp < 2:
            raise ValueError(f"--dp-attention needs --tensor-parallel-size 2 or more, got {tp}")
    if not 0 <= options.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--speculative-tokens must be 0..{MAX_SPECULATIVE_TOKENS} (our op verifies up to "
                         f"{MAX_SPECULATIVE_TOKENS + 1} queries per request), got {options.speculative_tokens}")
    dcp = options.decode_context_parallel_size
    if dcp != 1:
        if engine != "vllm":
            raise ValueError(f"--decode-context-parallel-size is a vLLM option; not supported by {engine}")
        if dcp < 1 or tp % dcp:
            raise ValueError(f"--decode-context-parallel-size {dcp} must divide --tensor-parallel-size {tp}")


def resolve_model(model: str, heads: int | None, layers: int | None, options: ParallelOptions, gpus: GpuInventory,
                  gpu_memory_fraction: float) -> dict:
    """The model config for the command line: checks the sharding and, where the GPU memory is known, that the
    weights fit; ``deepseek-v3`` without ``layers`` takes the most layers that fit. ValueError says what is wrong."""
    layout = options.layout
    if model == DEEPSEEK_V3_MODEL and layers is None:
        if gpus.memory_bytes is None:
            raise ValueError(f"--model {DEEPSEEK_V3_MODEL} without --layers needs the GPU memory to choose how many "
                             "layers fit; no GPU is visible: give --layers or --gpu-memory-gib")
        layers = most_layers_that_fit(released_deepseek_v3_config, layout, gpus.memory_bytes, gpu_memory_fraction,
                                      DEEPSEEK_V3_LAYERS)
        if layers == 0:
            raise ValueError(f"not one layer of {DEEPSEEK_V3_MODEL} fits {gpus.memory_bytes / GIB:.1f} GiB per GPU "
                             f"at --tensor-parallel-size {options.tensor_parallel_size}; use more GPUs")
    config = model_config(model, heads, layers)
    problem = layout_problem(config, layout)
    if problem:
        raise ValueError(problem)
    if gpus.memory_bytes is not None:
        problem = fit_problem(config, layout, gpus.memory_bytes, gpu_memory_fraction)
        if problem:
            raise ValueError(problem)
    return config
