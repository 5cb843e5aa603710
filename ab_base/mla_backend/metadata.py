"""The one canonical paged-KV decode metadata that every adapter produces and every kernel reads.

A request ``r`` owns ``num_pages(r) = ceil(kv_lens[r] / page_size)`` pages whose ids are
``page_table[page_table_start[r] : page_table_start[r] + num_pages(r)]``. That single "flat array
plus per-request start" form describes, without copying or padding:

* a padded vLLM block table ``[batch, max_pages]``: ``page_table = block_table.view(-1)``,
  ``page_table_start[r] = r * block_table.stride(0)``;
* SGLang/FlashInfer CSR: ``page_table = kv_indices``, ``page_table_start = kv_indptr[:-1]``.

Token ``t`` of request ``r`` lives at ``kv_cache[page_table[page_table_start[r] + t // page_size],
t % page_size]``. Queries are laid out by ``qo_indptr`` like FlashInfer's: request ``r`` owns query
tokens ``qo_indptr[r] : qo_indptr[r + 1]``; with ``s_q`` queries, query ``i`` sees KV positions
``< kv_lens[r] - s_q + i + 1`` (causal, the new tokens are the last ``s_q`` of the KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

INDEX_DTYPE = torch.int32


@dataclass
class MLADecodeMetadata:
    """Canonical decode metadata (all tensors on the device of the KV cache).

    Fields:
        kv_lens: int32 ``[batch]`` — KV length of each request, the new (query) tokens included.
        qo_indptr: int32 ``[batch + 1]`` — query-token offsets; ``qo_indptr[-1] == num_tokens``.
        page_table: int32 ``[num_entries]`` — flat page ids (a flattened block table or ``kv_indices``).
        page_table_start: int32 ``[batch]`` — index into ``page_table`` of each request's first page.
        page_size: tokens per page (``kv_cache.shape[1]``).
        q_len: queries per request when every request has the same number (decode: 1, MTP: 1 + drafts),
            else ``None`` (ragged; only the reference implementation accepts that). Host int, so kernels
            can specialise on it without a device sync.
        max_kv_len: optional host-side upper bound of ``kv_lens`` (used only to size work; never required).
        plan: the split-KV work plan, filled lazily by :func:`mla_backend.planner.plan_split_kv`
            (or ahead of time by an engine adapter into persistent CUDA-graph buffers).
    """

    kv_lens: torch.Tensor
    qo_indptr: torch.Tensor
    page_table: torch.Tensor
    page_table_start: torch.Tensor
    page_size: int
    q_len: int | None = 1
    max_kv_len: int | None = None
    plan: object | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv_lens.device

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_block_table(
        cls,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        q_len: int | None = None,
        qo_indptr: torch.Tensor | None = None,
        max_kv_len: int | None = None,
    ) -> "MLADecodeMetadata":
        """From a vLLM-style padded block table (no copy of the table).

        Args:
            block_table: int32 ``[batch, max_pages]``; rows may be a slice of a larger persistent buffer
                (only ``stride(1) == 1`` is required).
            seq_lens: int32 ``[batch]`` KV lengths including the new tokens.
            page_size: tokens per page (vLLM's kernel block size).
            q_len: queries per request when uniform (default 1 without ``qo_indptr``); with ``qo_indptr``
                give it too when the counts are uniform, else the batch counts as ragged (reference only).
            qo_indptr: optional int32 ``[batch + 1]`` query offsets.
        """
        _require(block_table.dim() == 2, "block_table", f"must be 2-D [batch, max_pages], got shape {tuple(block_table.shape)}")
        _require(block_table.dtype == INDEX_DTYPE, "block_table", f"must be int32, got {block_table.dtype}")
        _require(seq_lens.dim() == 1 and seq_lens.shape[0] == block_table.shape[0], "seq_lens",
                 f"must be [batch={block_table.shape[0]}], got shape {tuple(seq_lens.shape)}")
        batch = block_table.shape[0]
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            block_table = block_table.contiguous()
        row_stride = block_table.stride(0) if block_table.shape[1] > 0 else 0
        # A flat view of the storage the rows live in: [batch - 1] * stride + max_pages entries.
        flat_len = (batch - 1) * row_stride + block_table.shape[1] if batch > 0 else 0
        page_table = block_table.as_strided((flat_len,), (1,))
        start = torch.arange(batch, dtype=INDEX_DTYPE, device=block_table.device) * row_stride
        if qo_indptr is None:
            q_len = 1 if q_len is None else q_len
            qo_indptr = torch.arange(batch + 1, dtype=INDEX_DTYPE, device=block_table.device) * q_len
        return cls(seq_lens.to(INDEX_DTYPE), qo_indptr.to(INDEX_DTYPE), page_table, start, int(page_size),
                   q_len, max_kv_len)

    @classmethod
    def from_csr(
        cls,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        page_size: int,
        kv_last_page_len: torch.Tensor | None = None,
        kv_lens: torch.Tensor | None = None,
        qo_indptr: torch.Tensor | None = None,
        q_len: int | None = None,
        max_kv_len: int | None = None,
    ) -> "MLADecodeMetadata":
        """From SGLang/FlashInfer CSR page lists (no copy of ``kv_indices``).

        Args:
            kv_indptr: int32 ``[batch + 1]`` offsets into ``kv_indices`` (in pages).
            kv_indices: int32 ``[>= kv_indptr[-1]]`` page ids.
            page_size: tokens per page.
            kv_last_page_len: int32 ``[batch]`` tokens used in each request's last page (FlashInfer
                convention, ``1..page_size``; ignored for requests with no page). Give this or ``kv_lens``.
            kv_lens: int32 ``[batch]`` KV lengths (SGLang's ``seq_lens``), alternative to ``kv_last_page_len``.
            qo_indptr: optional int32 ``[batch + 1]``; default ``arange(batch + 1) * q_len``.
            q_len: queries per request when uniform (default 1 without ``qo_indptr``; ragged if omitted with it).
        """
        _require(kv_indptr.dim() == 1 and kv_indptr.shape[0] >= 1, "kv_indptr",
                 f"must be 1-D [batch + 1], got shape {tuple(kv_indptr.shape)}")
        _require(kv_indices.dim() == 1, "kv_indices", f"must be 1-D, got shape {tuple(kv_indices.shape)}")
        _require(kv_indices.dtype == INDEX_DTYPE, "kv_indices", f"must be int32, got {kv_indices.dtype}")
        batch = kv_indptr.shape[0] - 1
        indptr = kv_indptr.to(INDEX_DTYPE)
        if kv_lens is None:
            _require(kv_last_page_len is not None, "kv_last_page_len", "or kv_lens must be given")
            _require(kv_last_page_len.shape == (batch,), "kv_last_page_len",
                     f"must be [batch={batch}], got shape {tuple(kv_last_page_len.shape)}")
            num_pages = indptr[1:] - indptr[:-1]
            kv_lens = torch.where(num_pages > 0, (num_pages - 1) * page_size + kv_last_page_len.to(INDEX_DTYPE),
                                  torch.zeros_like(num_pages))
        else:
            _require(kv_lens.shape == (batch,), "kv_lens", f"must be [batch={batch}], got shape {tuple(kv_lens.shape)}")
        if qo_indptr is None:
            q_len = 1 if q_len is None else q_len
            qo_indptr = torch.arange(batch + 1, dtype=INDEX_DTYPE, device=kv_indptr.device) * q_len
        return cls(kv_lens.to(INDEX_DTYPE), qo_indptr.to(INDEX_DTYPE), kv_indices, indptr[:-1], int(page_size),
                   q_len, max_kv_len)

    # ------------------------------------------------------------------ helpers
    def num_pages(self) -> torch.Tensor:
        """int32 ``[batch]`` pages each request uses."""
        return (self.kv_lens + self.page_size - 1) // self.page_size

    def to(self, device: torch.device | str) -> "MLADecodeMetadata":
        move = lambda t: t.to(device)  # noqa: E731
        return MLADecodeMetadata(move(self.kv_lens), move(self.qo_indptr), move(self.page_table),
                                 move(self.page_table_start), self.page_size, self.q_len, self.max_kv_len)


def _require(ok: bool, arg: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{arg} {msg}")
