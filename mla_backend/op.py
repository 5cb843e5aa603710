"""The public decode op: ``mla_decode(q, kv_cache, metadata, softmax_scale)``."""

from __future__ import annotations

import torch

from .constants import KV_LORA_RANK
from .launcher import (Scales, capturing as _capturing, checked_fp8_compute, checked_k_scale, kernel_scales,
                       prepare_variant)
from .metadata import MLADecodeMetadata
from .planner import SplitPlan, plan_split_kv
from .validation import MLAInputError, check_inputs, normalize_kv_cache, split_query
from .verify import VERIFY, verification_report, verifying

__all__ = ["VERIFY", "mla_decode", "verification_report", "verifying"]


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
    fp8_compute: bool = False,
):
    """Multi-head latent attention over a paged latent cache (decode, MTP verify).

    Args:
        q: ``[num_tokens, num_heads, 576]``, or the pair ``(q_nope [.., 512], q_pe [.., 64])`` that
            engines hand over (read as two tensors, never concatenated).
        kv_cache: ``[num_pages, page_size, 576]``: latent c_kv in ``[..., :512]`` (also V), k_pe in
            ``[..., 512:]``. fp16/bf16 like q, or fp8 dequantised with ``k_scale``: float8_e4m3fn (sm90) or
            float8_e4m3fnuz (gfx942; MI300X's fp8); the reference reads either.
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
        fp8_compute: with an fp8 cache, let the sm90 kernel quantise q to e4m3 (one scale per (token, head) row) and
            run both products on e4m3 tensor cores, as the engines' built-in fp8 MLA backends do: faster where
            heads x q_len is large (compute-bound), with an error of a few 1e-2 of max|out| instead of a few 1e-3
            (docs/kernels.md, "fp8 compute"). Shapes of up to 16 rows, gfx942 and the reference keep q as it is.
            True with a 16-bit cache is refused. The engine plugins pass True unless ``MLA_BACKEND_FP8_COMPUTE=0``.
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
    k_scale = checked_k_scale(softmax_scale, k_scale, kv_cache.dtype, q_nope.device)
    fp8_compute = checked_fp8_compute(fp8_compute, kv_cache.dtype)
    num_tokens, num_heads, _ = q_nope.shape
    variant = prepare_variant(q_nope.device, num_heads, metadata.q_len, metadata.page_size, q_nope.dtype,
                              kv_cache.dtype, impl, fp8_compute)
    if variant.is_reference:
        if capturing:
            raise variant.capture_error()
        out, lse = variant.run(q_nope, q_pe, kv_cache, metadata, None, out, None, Scales(softmax_scale, k_scale))
        return (out, lse) if return_lse else out
    device = q_nope.device
    if out is None:
        out = torch.empty(num_tokens, num_heads, KV_LORA_RANK, dtype=q_nope.dtype, device=device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=device)
    if num_tokens:
        plan: SplitPlan = metadata.plan if metadata.plan is not None else plan_split_kv(metadata, num_heads)
        if plan.rows != num_heads * metadata.q_len or plan.cu_blocks.shape[0] < metadata.batch_size + 1:
            # a mismatched plan would index the partial buffers out of bounds
            raise MLAInputError(f"mla_decode: metadata.plan was made for {plan.rows} rows and max batch "
                                f"{plan.cu_blocks.shape[0] - 1}; this call has {num_heads * metadata.q_len} rows "
                                f"(heads x q_len) and batch {metadata.batch_size}")
        if plan.block_n != variant.block_n:
            raise MLAInputError(f"mla_decode: metadata.plan was made with {plan.block_n}-token blocks but the "
                                f"{variant.arch} kernel ({variant.kernel}) walks {variant.block_n}-token blocks; build "
                                "the SplitPlanner after choosing the kernel (block_n=None picks it)")
        variant.run(q_nope, q_pe, kv_cache, metadata, plan, out, lse,
                    kernel_scales(float(softmax_scale), k_scale, device))
    return (out, lse) if return_lse else out
