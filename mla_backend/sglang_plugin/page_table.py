"""SGLang ``req_to_token`` -> paged CSR translation, in plain torch (no sglang import).

SGLang addresses KV by token slot: ``req_to_token_pool.req_to_token`` is int32
``[max_reqs + 1, max_context_len]`` and maps (request row, position) to a slot of the KV pool.
With ``--page-size P`` the paged allocator hands out whole pages, so the slot of position ``t``
is ``page * P + t % P``; the page of a request's ``j``-th page is therefore
``req_to_token[row, j * P] // P`` (this is what SGLang's FlashMLA backend puts in its block
table). The MLA pool ``MLATokenToKVPool`` keeps one ``[size + P, 1, 576]`` tensor per layer, so
``get_key_buffer(layer).view(-1, P, 576)`` is exactly the ``[num_pages, P, 576]`` cache the op
reads, and these page ids index it directly.

Layout produced here ("row-strided CSR"): request ``r``'s page list starts at
``kv_indptr[r] = r * row_stride`` in the flat ``kv_indices``, where ``row_stride`` is the row
stride of a 2-D page-table buffer. It is a valid input to
:meth:`mla_backend.MLADecodeMetadata.from_csr` (which takes ``kv_lens`` and only reads
``ceil(kv_lens[r] / P)`` entries per request), and it has static shapes: the same buffers can
back a captured CUDA graph and be refilled before each replay.

Everything here is device-agnostic torch, so CI (CPU) tests the exact translation and metadata
assembly the SGLang backend uses on the GPU (where a Triton kernel from SGLang may replace
:func:`fill_page_table_torch`; see ``backend.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..metadata import INDEX_DTYPE, MLADecodeMetadata

#: ``fill(req_to_token, req_pool_indices, kv_lens, page_size, out)`` writes, for every request
#: ``r < bs`` and page ``j < ceil(kv_lens[r] / page_size)``, ``out[r, j] = req_to_token[
#: req_pool_indices[r], j * page_size] // page_size``. Entries past a request's last page are
#: never read by the op and may hold anything.
FillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], None]


def num_pages(kv_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages used by each request: ``ceil(kv_lens / page_size)`` (same dtype as ``kv_lens``)."""
    return (kv_lens + (page_size - 1)) // page_size


def max_pages_per_request(max_tokens: int, page_size: int) -> int:
    """Static page-table width that covers any request of up to ``max_tokens`` tokens."""
    return max(1, -(-int(max_tokens) // int(page_size)))


def fill_page_table_torch(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
) -> None:
    """Reference :data:`FillFn`: one gather over ``out``'s ``[bs, width]`` window.

    Entries past a request's last page are set to 0 (SGLang's dummy page), so the table never
    holds stale ids. Cost is ``bs * width`` gathers regardless of the real lengths.
    """
    bs, width = out.shape
    if bs == 0 or width == 0:
        return
    if (width - 1) * page_size >= req_to_token.shape[1]:
        raise ValueError(
            f"page table width {width} x page_size {page_size} exceeds req_to_token's "
            f"{req_to_token.shape[1]} columns")
    device = req_to_token.device
    cols = torch.arange(width, dtype=torch.int64, device=device)
    rows = req_pool_indices[:bs].to(device=device, dtype=torch.int64)
    slots = req_to_token[rows[:, None], (cols * page_size)[None, :]]  # [bs, width]
    pages = torch.div(slots, page_size, rounding_mode="floor").to(out.dtype)
    used = cols[None, :] < num_pages(kv_lens[:bs].to(device=device, dtype=torch.int64), page_size)[:, None]
    out.copy_(pages.masked_fill_(~used, 0))


def translate_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    page_size: int,
    *,
    width: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    fill: Optional[FillFn] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang page ids per request as a row-strided CSR.

    Args:
        req_to_token: int32 ``[rows, max_context_len]`` token-slot table (SGLang's ``req_to_token``).
        req_pool_indices: ``[bs]`` rows of ``req_to_token`` (int32 or int64).
        kv_lens: ``[bs]`` KV lengths to cover (SGLang's ``seq_lens``; plus the draft tokens for
            target-verify).
        page_size: tokens per page (``--page-size``).
        width: pages per row to fill. Default: the ``out`` buffer's width when given, else
            ``ceil(max(kv_lens) / page_size)`` (a host sync; fine for tests and eager use).
        out: optional int32 ``[>= bs, >= width]`` buffer (row stride = its ``stride(0)``, last
            dim contiguous). Rows ``< bs`` and columns ``< width`` are rewritten in place.
        fill: the page gather (default :func:`fill_page_table_torch`).

    Returns:
        ``(kv_indptr int32 [bs + 1], kv_indices int32 flat view of the buffer)`` with
        ``kv_indptr[r] = r * row_stride``.
    """
    bs = req_pool_indices.shape[0]
    device = req_to_token.device
    if out is None:
        if width is None:
            width = max_pages_per_request(int(kv_lens[:bs].max()) if bs else 1, page_size)
        out = torch.zeros(max(bs, 1), width, dtype=INDEX_DTYPE, device=device)
    else:
        if out.dim() != 2 or out.dtype != INDEX_DTYPE or out.stride(1) != 1:
            raise ValueError(f"out must be a 2-D int32 buffer with a contiguous last dim, got "
                             f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
        if width is None:
            width = out.shape[1]
        if out.shape[0] < bs or out.shape[1] < width:
            raise ValueError(f"out buffer {tuple(out.shape)} too small for batch {bs} x width {width}")
    (fill or fill_page_table_torch)(req_to_token, req_pool_indices, kv_lens, page_size, out[:bs, :width])
    row_stride = out.stride(0)
    kv_indptr = torch.arange(bs + 1, dtype=INDEX_DTYPE, device=device) * row_stride
    # A flat view over the rows the indptr addresses (the buffer may be a row slice of a larger one).
    flat_len = (out.shape[0] - 1) * row_stride + out.shape[1]
    kv_indices = out.as_strided((flat_len,), (1,))
    return kv_indptr, kv_indices


def _refill_kv_lens(seq_lens: torch.Tensor, num_draft_tokens: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` (int32 ``[bs]``) = ``seq_lens[:bs] + num_draft_tokens``: SGLang's committed lengths plus the drafts
    written before attention."""
    out.copy_(seq_lens[: out.shape[0]])
    if num_draft_tokens:
        out.add_(int(num_draft_tokens))
    return out


def refill_decode_buffers(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    *,
    num_draft_tokens: int = 0,
    width: Optional[int] = None,
    fill: Optional[FillFn] = None,
) -> torch.Tensor:
    """One step's device ops into persistent buffers: ``kv_lens[:bs] = seq_lens + num_draft_tokens`` (int32
    ``[max_bs]``) and each request's page ids into ``page_table[:bs, :width]`` (int32 ``[max_bs, W]``). Returns
    ``kv_lens[:bs]``. Metadata built once over these buffers (views) reads the new values."""
    bs = req_pool_indices.shape[0]
    kv_lens = _refill_kv_lens(seq_lens, num_draft_tokens, kv_lens[:bs])
    if bs:
        w = page_table.shape[1] if width is None else width
        (fill or fill_page_table_torch)(req_to_token, req_pool_indices, kv_lens, page_size, page_table[:bs, :w])
    return kv_lens


def sglang_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    *,
    num_draft_tokens: int = 0,
    width: Optional[int] = None,
    page_table: Optional[torch.Tensor] = None,
    kv_indptr: Optional[torch.Tensor] = None,
    kv_lens: Optional[torch.Tensor] = None,
    qo_indptr: Optional[torch.Tensor] = None,
    fill: Optional[FillFn] = None,
) -> MLADecodeMetadata:
    """The :class:`MLADecodeMetadata` of an SGLang DECODE or TARGET_VERIFY batch.

    SGLang semantics: in DECODE, ``seq_lens`` already counts the token being decoded (its KV is
    written before attention); in TARGET_VERIFY, ``seq_lens`` is the committed prefix and the
    ``num_draft_tokens`` draft tokens sit at positions ``seq_lens .. seq_lens + n - 1`` of
    ``req_to_token`` (written before attention). So ``kv_lens = seq_lens + num_draft_tokens`` and
    ``q_len = max(1, num_draft_tokens)``, causal among the drafts (EAGLE/MTP with topk 1).

    Persistent-buffer mode (CUDA graphs): pass ``page_table`` (int32 ``[max_bs, W]``),
    ``kv_indptr`` (int32 ``[max_bs + 1]``, already ``arange * page_table.stride(0)``),
    ``kv_lens`` (int32 ``[max_bs]``) and ``qo_indptr`` (int32 ``[max_bs + 1]``, already
    ``arange * q_len``). Every tensor of the result is then a view of those buffers, so a graph
    captured with it reads fresh values after this function refills them; only device ops run.
    """
    bs = req_pool_indices.shape[0]
    device = req_to_token.device
    q_len = max(1, int(num_draft_tokens))
    if page_table is not None and kv_indptr is not None:
        kv_lens = refill_decode_buffers(req_to_token, req_pool_indices, seq_lens, page_size, kv_lens, page_table,
                                        num_draft_tokens=num_draft_tokens, width=width, fill=fill)
        indptr, indices = kv_indptr, page_table.view(-1)
    else:
        out = torch.empty(bs, dtype=INDEX_DTYPE, device=device) if kv_lens is None else kv_lens[:bs]
        kv_lens = _refill_kv_lens(seq_lens, num_draft_tokens, out)
        indptr, indices = translate_page_table(req_to_token, req_pool_indices, kv_lens, page_size, width=width,
                                               out=page_table, fill=fill)
    # A persistent qo_indptr (already arange * q_len) is passed together with q_len, so the batch stays
    # uniform (kernel path) and the metadata reads that buffer.
    return MLADecodeMetadata.from_csr(indptr[: bs + 1], indices, page_size, kv_lens=kv_lens,
                                      qo_indptr=None if qo_indptr is None else qo_indptr[: bs + 1], q_len=q_len)
