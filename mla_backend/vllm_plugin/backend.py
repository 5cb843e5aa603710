"""vLLM (0.26 .. 0.33) attention backend classes for the TileLang MLA decode op (imported by vLLM on selection).

A thin adapter: prefill, chunked prefill, prefix caching, the KV-cache write and the W_UK / W_UV
projections are all inherited from vLLM's MLA common classes; this module only turns vLLM's decode
metadata into :class:`~mla_backend.MLADecodeMetadata` (see :mod:`.translate`) and launches the decode from
``forward_mqa`` through each layer's :class:`~mla_backend.MLADecodeLauncher`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType

from ..constants import HEAD_DIM, KV_LORA_RANK, MAX_HEADS, MAX_Q_LEN, ROPE_DIM
from ..dispatch import (ENV_IMPL, TILELANG_GFX942, engine_fp8_compute, engine_impl_request, tilelang_available,
                        warmup)
from ..host_trace import host_range
from ..launcher import MLADecodeLauncher
from ..metadata import MLADecodeMetadata
from ..planner import SplitPlanner
from .translate import DecodeMetadataBuilder, decode_q_len_limit

# A child of vLLM's logger, so these lines appear in vLLM's log with its format and level.
logger = init_logger("vllm.mla_backend")

HEAD_SIZE = HEAD_DIM  # kv_lora_rank 512 + qk_rope_head_dim 64
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
_KV_DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``forward_mqa`` sees the cache in for a vLLM ``--kv-cache-dtype``."""
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return torch.float8_e4m3fn
    return _KV_DTYPE_NAMES.get(kv_cache_dtype, model_dtype)


def dcp_size(vllm_config: VllmConfig) -> int:
    """vLLM's decode context parallel size (1 where this release has none)."""
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def decode_heads(vllm_config: VllmConfig) -> int:
    """Query heads of one decode call: the GPU's heads, times the DCP size under decode context parallelism (vLLM
    all-gathers q over the DCP group, so each rank attends every head of the group over its share of the tokens and
    merges the ranks' outputs by the LSE this backend returns)."""
    return vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config) * dcp_size(vllm_config)


def decode_q_lens(vllm_config: VllmConfig) -> tuple[int, ...]:
    """The decode query lengths vLLM can route to this backend: 1 + drafts with MTP; only 1 under DCP (vLLM then
    sends longer rows to its prefill path, this backend not handling DCP with several queries)."""
    spec = vllm_config.speculative_config
    if dcp_size(vllm_config) > 1 or spec is None or not spec.num_speculative_tokens:
        return (1,)
    limit = decode_q_len_limit(spec.num_speculative_tokens, bool(getattr(spec, "parallel_drafting", False)))
    return tuple(range(1, limit + 1))


def draft_backend_hint(speculative_config) -> str | None:
    """What to tell a user whose MTP drafter will not run on this backend: vLLM's drafter never inherits
    ``--attention-backend`` and picks its own (FLASH_ATTN_MLA on Hopper) unless the speculative config names one.
    None without speculative decoding or where the config names a backend."""
    if speculative_config is None or not speculative_config.num_speculative_tokens:
        return None
    if getattr(speculative_config, "attention_backend", None) is not None:
        return None
    return ("mla_backend (vLLM CUSTOM): the MTP drafter picks its own attention backend (vLLM does not pass "
            "--attention-backend on to it); put \"attention_backend\": \"CUSTOM\" in --speculative-config to run "
            "its attention on this backend too")


def config_problems(vllm_config: VllmConfig | None) -> list[str]:
    """Engine settings this backend cannot serve (heads per call, spec-decode depth, prefill context parallelism)."""
    if vllm_config is None or vllm_config.model_config is None:
        return []
    problems = []
    heads, dcp = decode_heads(vllm_config), dcp_size(vllm_config)
    if heads > MAX_HEADS:
        where = f"query heads per GPU x decode context parallel size {dcp}" if dcp > 1 else "query heads per GPU"
        problems.append(f"{heads} {where} (the TileLang kernels take <= {MAX_HEADS}; raise "
                        f"--tensor-parallel-size)")
    q_len = max(decode_q_lens(vllm_config))
    if q_len > MAX_Q_LEN:
        spec = vllm_config.speculative_config
        problems.append(f"decode query length {q_len} (1 + drafts from num_speculative_tokens="
                        f"{spec.num_speculative_tokens}); the TileLang kernels take <= {MAX_Q_LEN}")
    if getattr(vllm_config.parallel_config, "prefill_context_parallel_size", 1) > 1:
        problems.append("prefill context parallelism (PCP) is not supported")
    return problems


def platform_problems() -> list[str]:
    """ROCm: the gfx942 kernel lowers in CI but has not run on an MI300X, so it is opt-in (docs/amd.md)."""
    try:
        request = engine_impl_request()
    except ValueError as exc:
        return [str(exc)]
    from vllm.platforms import current_platform

    if current_platform.is_rocm() and request != TILELANG_GFX942:
        return [f"on ROCm the TileLang gfx942 kernel is unverified on hardware; set {ENV_IMPL}={TILELANG_GFX942} "
                "to use it (docs/amd.md)"]
    return []


class TileLangMLABackend(MLACommonBackend):
    """DeepSeek-style MLA (head size 576) decode on Hopper through TileLang kernels."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *FP8_KV_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        # Must name an AttentionBackendEnum member: vLLM maps names back with AttentionBackendEnum[name].
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type["TileLangMLAImpl"]:
        return TileLangMLAImpl

    @staticmethod
    def get_builder_cls() -> type["TileLangMLAMetadataBuilder"]:
        return TileLangMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(*args, **kwargs) -> list[int]:
        # Exact sizes, not MultipleOf: a larger --block-size (e.g. 256) is split by vLLM into kernel
        # blocks of the largest size here that divides it. (*args: vLLM >= 0.33 passes kv_cache_spec.)
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        # sm_90 (H100 / H200); vLLM's ROCm platform reports MI300X (gfx942) as 9.4
        return (capability.major, capability.minor) in ((9, 0), (9, 4))

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # vLLM >= 0.33 (adaptive verification of dspark drafts) may trim query lengths on the device only;
        # the decode path plans from the host query_start_loc (one uniform q_len), so opt out and let
        # validate_configuration refuse that combination. vLLM 0.26 never calls this.
        return False

    @classmethod
    def supported_kv_cache_layouts(cls):
        # vLLM >= 0.33 resolves one physical KV-cache layout for all layers (VLLM_KV_CACHE_LAYOUT, KV
        # connectors). The kernels read a layer's cache as dense [num_pages, page_size, 576] pages, which
        # only the layer-outermost layouts give (MLA has one KV head, so H's place does not matter);
        # block-outermost ones (BL...) interleave the layers inside a block. vLLM 0.26 has no such hook:
        # its MLA caches are always layer-outermost.
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                             block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability) -> str | None:
        reasons = []
        if not tilelang_available():
            reasons.append("tilelang is not installed (pip install tilelang==0.1.9)")
        if kv_cache_dtype in _KV_DTYPE_NAMES and _KV_DTYPE_NAMES[kv_cache_dtype] != dtype:
            reasons.append(f"kv_cache_dtype {kv_cache_dtype} with model dtype {dtype} (the kernels take the "
                           f"model dtype or fp8)")
        reasons += config_problems(get_current_vllm_config_or_none())
        reasons += platform_problems()
        return "; ".join(reasons) if reasons else None


@dataclass
class TileLangMLADecodeMetadata(MLACommonDecodeMetadata):
    #: canonical metadata over persistent buffers; its plan buffers are filled by the step's first decode call
    mla: MLADecodeMetadata | None = None
    #: the planner that makes ``mla.plan`` for this step, until the step's first decode call has run it
    planner: SplitPlanner | None = None


@dataclass
class TileLangMLAMetadata(MLACommonMetadata[TileLangMLADecodeMetadata]):
    pass


class TileLangMLAMetadataBuilder(MLACommonMetadataBuilder[TileLangMLAMetadata]):
    # Full CUDA graphs for uniform decode batches, q_len = 1 + num_speculative_tokens included: every
    # tensor the kernels read lives in persistent storage refilled by _build_decode (outside the graph).
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    # vLLM raises this to 1 + num_speculative_tokens (UNIFORM support), so MTP verify rows run here.
    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, TileLangMLAMetadata)
        route_core_logs()
        problems = config_problems(vllm_config)
        if self.reorder_batch_threshold > MAX_Q_LEN:
            problems.append(f"decode query length up to {self.reorder_batch_threshold}; the kernels take "
                            f"<= {MAX_Q_LEN}")
        if problems:
            raise ValueError("mla_backend (CUSTOM): " + "; ".join(problems))
        hint = draft_backend_hint(vllm_config.speculative_config)
        if hint:
            getattr(logger, "info_once", logger.info)(hint)
        q_lens = range(1, self.reorder_batch_threshold + 1)
        heads = decode_heads(vllm_config)  # the heads forward_mqa sees (DCP: the group's, all-gathered)
        self._decode = DecodeMetadataBuilder(vllm_config.scheduler_config.max_num_seqs, heads, self.page_size, q_lens,
                                             device)
        model_dtype = self.model_config.dtype
        kv_dtype = kv_torch_dtype(vllm_config.cache_config.cache_dtype, model_dtype)
        warm_up_kernels(torch.device(device), model_dtype, kv_dtype, heads, self.page_size, self._decode.q_lens,
                        self._decode.plan_buffer_bytes(), engine_fp8_compute() and kv_dtype != model_dtype)

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor, max_seq_len: int,
                      query_start_loc_cpu: torch.Tensor, query_start_loc_device: torch.Tensor,
                      num_decode_tokens: int, dcp_tot_seq_lens_device: torch.Tensor | None,
                      **kwargs) -> TileLangMLADecodeMetadata:
        # vLLM passes keywords only; **kwargs takes what newer releases add (0.33: max_query_len).
        # The split plan is made by the step's first decode call (forward_mqa), not here: under full CUDA graphs that
        # launch is captured with the layers, so a replay step builds on the host without launching anything.
        with host_range("vllm.build_decode"):
            mla = self._decode.build(block_table_tensor, seq_lens_device, query_start_loc_cpu, num_decode_tokens,
                                     max_seq_len, plan=False)
        return TileLangMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                         dcp_tot_seq_lens=dcp_tot_seq_lens_device, mla=mla,
                                         planner=self._decode.planner(mla.q_len))


class TileLangMLAImpl(MLACommonImpl[TileLangMLAMetadata]):
    can_return_lse_for_decode: bool = True  # natural-log LSE, as vLLM expects (lse_base_on_e)
    supports_pcp: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None,
                 **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        unsupported = [name for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                                ("logits_soft_cap", logits_soft_cap)) if value]
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if not 1 <= num_heads <= MAX_HEADS:
            unsupported.append(f"{num_heads} heads (1..{MAX_HEADS})")
        if head_size != HEAD_SIZE or self.kv_lora_rank != KV_LORA_RANK or self.qk_rope_head_dim != ROPE_DIM:
            unsupported.append(f"head size {head_size} (kv_lora_rank {self.kv_lora_rank} + rope "
                               f"{self.qk_rope_head_dim}); the kernels take 512 + 64")
        if kv_cache_dtype not in TileLangMLABackend.supported_kv_cache_dtypes:
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        unsupported += config_problems(get_current_vllm_config())
        if unsupported:
            raise NotImplementedError("TileLangMLAImpl (attention backend CUSTOM) does not support: "
                                      + "; ".join(unsupported))
        self._fp8_cache = kv_cache_dtype in FP8_KV_CACHE_DTYPES
        self._impl = engine_impl_request()  # "auto", or e.g. tilelang-gfx942 on an MI300X (opt-in)
        # q arrives in the model dtype: with an fp8 cache the kernels quantise it per (token, head) row themselves
        # (fp8_compute, MLA_BACKEND_FP8_COMPUTE) or keep it and dequantise K/V with k_scale.
        self.supports_quant_query_input = False
        self._fp8_compute = engine_fp8_compute() and self._fp8_cache
        # The decode query lengths the metadata builder plans for (its reorder threshold), compiled at the launcher's
        # build; built at this layer's first decode (vLLM's warm-up runs eagerly before it captures graphs).
        self._q_lens = tuple(q for q in decode_q_lens(get_current_vllm_config()) if q <= MAX_Q_LEN)
        self._launch: MLADecodeLauncher | None = None

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: TileLangMLAMetadata, layer: AttentionLayer
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = attn_metadata.decode
        assert decode is not None and decode.mla is not None
        with host_range("vllm.forward_mqa"):
            planner = decode.planner
            if planner is not None:  # the step's first layer: its plan, for every layer (captured in a full graph)
                decode.planner = None
                planner.plan(decode.mla.kv_lens)
            q_nope, q_pe = q if isinstance(q, tuple) else (q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:])
            launch = self._launch or self._build_launcher(q_nope, kv_c_and_k_pe_cache, layer)
            if self.need_to_return_lse_for_decode:  # a new LSE tensor, which DCP's merge reads after this call
                return launch(q_nope, q_pe, kv_c_and_k_pe_cache, decode.mla, return_lse=True)
            return launch(q_nope, q_pe, kv_c_and_k_pe_cache, decode.mla), None

    def _build_launcher(self, q_nope: torch.Tensor, kv_cache: torch.Tensor, layer: AttentionLayer
                        ) -> MLADecodeLauncher:
        # layer._k_scale: vLLM's fp32 scale buffer, read by the kernels at each launch (loaded checkpoints refill it)
        self._launch = MLADecodeLauncher(q_nope.device, q_nope.shape[1], page_size=kv_cache.shape[1],
                                         dtype=q_nope.dtype, kv_dtype=kv_cache.dtype, softmax_scale=self.scale,
                                         k_scale=layer._k_scale if self._fp8_cache else None, q_lens=self._q_lens,
                                         impl=self._impl, fp8_compute=self._fp8_compute)
        return self._launch


def route_core_logs() -> None:
    """Send the core's ``mla_backend`` logger (kernel choice, compile times) to vLLM's handlers, unless the
    application configured logging itself."""
    core, vllm_logger = logging.getLogger("mla_backend"), logging.getLogger("vllm")
    if core.handlers or logging.getLogger().handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        core.addHandler(handler)
    core.setLevel(vllm_logger.level)
    core.propagate = False


def warm_up_kernels(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, num_heads: int, page_size: int,
                    q_lens, plan_bytes: int = 0, fp8_compute: bool = False) -> list[tuple]:
    """Compile (or load from TileLang's disk cache) every kernel variant the engine can launch, before vLLM
    captures CUDA graphs (``mla_backend.warmup``). Returns the variant keys. Raises where the op would fall back to
    the reference implementation on a GPU (it syncs the host and cannot be graph-captured)."""
    if device.type != "cuda":
        return []
    try:
        # One process at a time: vLLM's workers may be daemonic and cannot start a compile pool.
        ready = warmup(device, num_heads, q_lens, page_size, dtype, kv_dtype, impl=engine_impl_request(), workers=1,
                       fp8_compute=fp8_compute)
    except RuntimeError as exc:
        raise RuntimeError(f"mla_backend (CUSTOM): {exc}") from exc
    logger.info("mla_backend (vLLM CUSTOM): %d TileLang decode kernel(s) ready in %.1fs: heads=%d page=%d %s/%s "
                "q_len=%s; split-KV plan buffers %.1f MiB", len(ready.variants), ready.seconds, num_heads, page_size,
                dtype, kv_dtype, list(q_lens), plan_bytes / 2**20)
    return list(ready.variants)
