"""Pure-PyTorch MLA decode: the test oracle and the fallback where no kernel exists (CPU included).

Accumulates in float32, one request at a time, gathering that request's pages. Exactly the op of
:func:`mla_backend.mla_decode`: causal for ``s_q > 1``, zeros and LSE ``-inf`` where a query sees no KV
(decided by the lengths, never by the scores). A NaN or inf in q or in a visible cache row is not hidden:
it reaches that query's output and LSE (NaN), as in FlashMLA and FlashAttention-3.
"""

from __future__ import annotations

import torch

from .constants import HEAD_DIM, KV_LORA_RANK, ROPE_DIM  # noqa: F401 (ROPE_DIM: re-exported)
from .metadata import MLADecodeMetadata


def mla_decode_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: MLADecodeMetadata,
    softmax_scale: float,
    k_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention.

    Args:
        q_nope: ``[num_tokens, num_heads, 512]``; q_pe: ``[num_tokens, num_heads, 64]``.
        kv_cache: ``[num_pages, page_size, 576]`` (fp8 caches are dequantised with ``k_scale``).
    Returns:
        ``out [num_tokens, num_heads, 512]`` in ``q_nope.dtype`` and ``lse [num_tokens, num_heads]`` fp32.
    """
    num_tokens, num_heads, _ = q_nope.shape
    device = q_nope.device
    out32 = torch.zeros(num_tokens, num_heads, KV_LORA_RANK, dtype=torch.float32, device=device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=device)
    kv_lens = metadata.kv_lens.tolist()
    qo_indptr = metadata.qo_indptr.tolist()
    starts = metadata.page_table_start.tolist()
    page_size = metadata.page_size
    for r, kv_len in enumerate(kv_lens):
        q_begin, q_end = qo_indptr[r], qo_indptr[r + 1]
        s_q = q_end - q_begin
        if s_q == 0 or kv_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        pages = metadata.page_table[starts[r] : starts[r] + num_pages].long()
        kv = kv_cache[pages].reshape(-1, HEAD_DIM)[:kv_len].float() * k_scale  # [kv_len, 576]
        q = torch.cat([q_nope[q_begin:q_end], q_pe[q_begin:q_end]], dim=-1).float()  # [s_q, H, 576]
        scores = torch.einsum("shd,td->sht", q, kv) * softmax_scale  # [s_q, H, kv_len]
        # Query i (of s_q) sees positions < kv_len - s_q + i + 1; it reads only those (never a masked row's
        # values, which could be anything), and a query that sees none keeps its zeros and LSE -inf. No
        # nan_to_num: a NaN (or inf) score from the inputs must reach the output, not turn into zeros.
        for i in range(s_q):
            seen = min(kv_len - s_q + i + 1, kv_len)
            if seen <= 0:
                continue
            s_i = scores[i, :, :seen]  # [H, seen]
            lse_i = torch.logsumexp(s_i, dim=-1)  # [H]; NaN where a score is NaN
            probs = torch.exp(s_i - lse_i[:, None])
            out32[q_begin + i] = probs @ kv[:seen, :KV_LORA_RANK]
            lse[q_begin + i] = lse_i
    if out is None:
        return out32.to(q_nope.dtype), lse
    out.copy_(out32)
    return out, lse
