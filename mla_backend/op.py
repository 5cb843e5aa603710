"""The public decode op: ``mla_decode(q, kv_cache, metadata, softmax_scale)``."""

from __future__ import annotations

import logging
import os

import torch

from .dispatch import REFERENCE, log_choice, select_impl
from .metadata import MLADecodeMetadata
from .planner import SplitPlan, plan_split_kv
from .reference import mla_decode_reference
from .constants import KV_LORA_RANK
from .validation import FP8_DTYPES, MLAInputError, check_inputs, check_scales, fail, normalize_kv_cache, split_query

logger = logging.getLogger("mla_backend")
_SCALARS: dict[tuple, torch.Tensor] = {}
# MLA_BACKEND_VERIFY=1: recompute every eager kernel call with the fp32 reference (on the kernel's device)
# and keep the worst relative error (a debugging aid for engine integrations: it syncs, so never in production).
VERIFY = {"calls": 0, "max_rel_err": 0.0, "max_lse_err": 0.0, "calls_by_q_len": {}}


# Read once, when the op is imported (an engine sets it before it loads the plugin), not on every call.
_VERIFY_ON = os.environ.get("MLA_BACKEND_VERIFY") == "1"


def verifying() -> bool:
    """MLA_BACKEND_VERIFY=1 at import: eager kernel calls are recomputed by the reference (results in ``VERIFY``)."""
    return _VERIFY_ON


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A cached fp32 ``[1]`` device tensor (kernel argument) so steady-state calls copy nothing."""
    key = (float(value), device)
    t = _SCALARS.get(key)
    if t is None:
        if _capturing(device):
            raise MLAInputError(f"mla_decode: softmax_scale/k_scale {value} first seen during CUDA-graph capture; "
                                "run one eager call with the same scales before capturing")
        t = _SCALARS[key] = torch.tensor([float(value)], dtype=torch.float32, device=device)
    return t


def mla_decode(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    metadata: MLADecodeMetadata,
    softmax_scale: float,
    *,
    k_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    impl: str = "auto",
    check_indices: bool | None = None,
):
    """Multi-head latent attention over a paged latent cache (decode, MTP verify).

    Args:
        q: ``[num_tokens, num_heads, 576]``, or the pair ``(q_nope [.., 512], q_pe [.., 64])`` that
            engines hand over (read as two tensors, never concatenated).
        kv_cache: ``[num_pages, page_size, 576]``: latent c_kv in ``[..., :512]`` (also V), k_pe in
            ``[..., 512:]``. fp16/bf16 like q, or float8_e4m3fn dequantised with ``k_scale``.
        metadata: :class:`MLADecodeMetadata` (``q_len`` queries per request; causal when > 1).
        softmax_scale: the model's scale, finite and positive (DeepSeek: ``192 ** -0.5`` times yarn mscale², not
            ``576 ** -0.5``).
        k_scale: per-tensor dequantisation scale of an fp8 cache, positive (float or fp32 device tensor); required
            with an fp8 cache (1.0 for a plain cast), refused (unless 1.0) with a 16-bit one.
        out: optional ``[num_tokens, num_heads, 512]`` output buffer (q's dtype).
        return_lse: also return the natural-log LSE ``[num_tokens, num_heads]`` float32.
        impl: "auto" (fastest available, logged), "reference", "tilelang-sm90" or "tilelang-gfx942".
        check_indices: validate the metadata's values on the host (a device sync): lengths within each request's
            own pages, offsets, page ids (``validation.check_metadata_values``). Default: on, except during
            CUDA-graph capture. Engine adapters pass False on their hot path.
    Returns:
        ``out``, or ``(out, lse)`` when ``return_lse``. A query that sees no KV gives zeros and LSE -inf; a NaN or
        inf in q or in a visible cache row gives NaN in that query's output row (never zeros).
    """
    q_nope, q_pe = split_query(q)
    kv_cache = normalize_kv_cache(kv_cache)
    capturing = _capturing(q_nope.device)
    if check_indices is None:
        check_indices = not capturing
    check_inputs(q_nope, q_pe, kv_cache, metadata, out, check_indices)
    check_scales(softmax_scale, k_scale, q_nope.device)
    num_tokens, num_heads, _ = q_nope.shape
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    if is_fp8 and k_scale is None:
        fail("k_scale", None, f"the dequantisation scale of the {kv_cache.dtype} kv_cache (real = stored * k_scale): "
             "a finite positive float or an fp32 device tensor; 1.0 for a plain cast")
    if not is_fp8:
        if k_scale is not None and not isinstance(k_scale, torch.Tensor) and float(k_scale) != 1.0:
            raise MLAInputError(f"mla_decode: k_scale={k_scale} is only meaningful for an fp8 kv_cache, "
                                f"got {kv_cache.dtype}")
        k_scale = None  # fp16/bf16 caches are unscaled (an engine's unit scale tensor is ignored)
    choice = select_impl(q_nope.device, q_nope.dtype, kv_cache.dtype, num_heads, metadata.q_len, metadata.page_size,
                         impl)
    log_choice(choice, (q_nope.device.type, q_nope.dtype, kv_cache.dtype, num_heads, metadata.q_len,
                        metadata.page_size))
    if choice.impl == REFERENCE:
        if capturing:  # the reference reads the lengths on the host: torch would fail deep inside it
            raise MLAInputError(f"mla_decode: the PyTorch reference path ({choice.reason}) cannot run inside "
                                "CUDA-graph capture; run eagerly, or on a GPU the TileLang kernel supports")
        scale = float(k_scale) if k_scale is not None else 1.0
        out, lse = mla_decode_reference(q_nope, q_pe, kv_cache, metadata, softmax_scale, scale, out)
    else:
        out, lse = _run_kernel(choice.impl, q_nope, q_pe, kv_cache, metadata, softmax_scale, k_scale, out)
        if verifying() and not capturing:
            _verify(q_nope, q_pe, kv_cache, metadata, softmax_scale, k_scale, out, lse)
    return (out, lse) if return_lse else out


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _verify(q_nope, q_pe, kv_cache, metadata, softmax_scale, k_scale, out, lse) -> None:
    scale = float(k_scale) if k_scale is not None else 1.0
    # on the kernel's device: the reference gathers only each request's pages, never the whole cache
    ref, ref_lse = mla_decode_reference(q_nope, q_pe, kv_cache, metadata, softmax_scale, scale)
    err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0
    VERIFY["calls"] += 1
    by_q_len = VERIFY["calls_by_q_len"]
    by_q_len[str(metadata.q_len)] = by_q_len.get(str(metadata.q_len), 0) + 1
    VERIFY["max_rel_err"] = max(VERIFY["max_rel_err"], err)
    VERIFY["max_lse_err"] = max(VERIFY["max_lse_err"], lse_err)
    if err > 2e-2 or lse_err > 1e-2:
        logger.warning("mla_backend verify: rel err %.3e, LSE err %.3e (batch %d, q_len %s, page %d)", err, lse_err,
                       metadata.batch_size, metadata.q_len, metadata.page_size)


def _rows_aligned(x: torch.Tensor) -> torch.Tensor:
    step = 16 // x.element_size()
    if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(s % step == 0 for s in x.stride()[:-1]):
        return x
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _run_kernel(impl: str, q_nope, q_pe, kv_cache, metadata: MLADecodeMetadata, softmax_scale, k_scale, out):
    from .kernels.configs import config_for
    from .kernels.runtime import get_kernels, pick_combine

    num_tokens, num_heads, _ = q_nope.shape
    device = q_nope.device
    if out is None:
        out = torch.empty(num_tokens, num_heads, KV_LORA_RANK, dtype=q_nope.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return out, lse
    plan: SplitPlan = metadata.plan if metadata.plan is not None else plan_split_kv(metadata, num_heads)
    if plan.rows != num_heads * metadata.q_len or plan.cu_blocks.shape[0] < metadata.batch_size + 1:
        # a mismatched plan would index the partial buffers out of bounds
        raise MLAInputError(f"mla_decode: metadata.plan was made for {plan.rows} rows and max batch "
                            f"{plan.cu_blocks.shape[0] - 1}; this call has {num_heads * metadata.q_len} rows "
                            f"(heads x q_len) and batch {metadata.batch_size}")
    arch = impl.split("-", 1)[1]
    cfg = config_for(arch)
    if plan.block_n != cfg.block_n:
        raise MLAInputError(f"mla_decode: metadata.plan was made with {plan.block_n}-token blocks but the {arch} "
                            f"kernel ({cfg.kernel}) walks {cfg.block_n}-token blocks; build the "
                            f"SplitPlanner after choosing the kernel (block_n=None picks it)")
    kernels = get_kernels(num_heads, metadata.q_len, metadata.page_size, q_nope.dtype, kv_cache.dtype, arch, cfg)
    if isinstance(k_scale, torch.Tensor):
        k_scale_t = k_scale.reshape(1).float()
    else:
        k_scale_t = _scalar(1.0 if k_scale is None else k_scale, device)
    batch = metadata.batch_size
    cu_blocks = plan.cu_blocks[: batch + 1]
    # The kernels read q through its (token, head) strides: the last dim must be dense and rows
    # 16-byte aligned (vectorised / cp.async loads); anything else is copied once.
    q_nope, q_pe = _rows_aligned(q_nope), _rows_aligned(q_pe)
    kernels.split(q_nope, q_pe, kv_cache, k_scale_t, metadata.page_table, metadata.page_table_start, metadata.kv_lens,
          metadata.qo_indptr, cu_blocks, plan.part_begin_req, plan.part_end_req, plan.blocks_per_part,
          _scalar(softmax_scale, device), out, lse, plan.out_partial, plan.lse_partial, plan.merge_count)
    # The combine runs whatever the split kernel merged itself: it writes empty requests and merges the requests with
    # more parts than that (the host does not know the lengths).
    combine = pick_combine(kernels, batch, plan.rows, plan.num_parts)
    combine(metadata.qo_indptr, cu_blocks, plan.blocks_per_part, plan.out_partial, plan.lse_partial, out, lse)
    return out, lse


def verification_report() -> dict | None:
    """Under MLA_BACKEND_VERIFY=1, a copy of the verification counters (``calls``, ``max_rel_err``, ``max_lse_err``,
    ``calls_by_q_len``); None while verification is off."""
    if not verifying():
        return None
    return dict(VERIFY, calls_by_q_len=dict(VERIFY["calls_by_q_len"]))
