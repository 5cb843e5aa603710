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

The constructors check what they can without reading device memory (types, shapes, dtypes, devices,
host ints); the checks of the values (each request's length within its own pages, ``kv_indptr``
non-decreasing from 0, ``kv_last_page_len`` in range, page ids in the cache) need a device sync and run in
:func:`mla_backend.mla_decode` with ``check_indices`` (or :meth:`MLADecodeMetadata.check`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

from .constants import MAX_Q_LEN

INDEX_DTYPE = torch.int32
# Index tensors the constructors take: int32 is used in place; int64 is converted (a copy) to int32.
_CONVERTED_DTYPES = (torch.int64,)


class MLAInputError(ValueError):
    """Invalid argument to the MLA decode op or to a metadata constructor."""


@dataclass(frozen=True)
class MetadataSource:
    """What a constructor was given beyond the canonical fields, kept by reference (no copy, no device op) so that
    the value checks of ``mla_decode(check_indices=True)`` can hold each request to its own pages.

    layout: ``"block_table"`` or ``"csr"``.
    row_pages: the block table's width (pages per row), for ``"block_table"``.
    kv_indptr: int32 ``[batch + 1]``, for ``"csr"``.
    kv_last_page_len: int32 ``[batch]`` when ``from_csr`` was given it (else ``None``).
    """

    layout: str
    row_pages: int | None = None
    kv_indptr: torch.Tensor | None = None
    kv_last_page_len: torch.Tensor | None = None

    def to(self, device) -> "MetadataSource":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return MetadataSource(self.layout, self.row_pages, move(self.kv_indptr), move(self.kv_last_page_len))


@dataclass
class MLADecodeMetadata:
    """Canonical decode metadata (all tensors on the device of the KV cache).

    Fields:
        kv_lens: int32 ``[batch]`` — KV length of each request, the new (query) tokens included.
        qo_indptr: int32 ``[batch + 1]`` — query-token offsets; ``qo_indptr[-1] == num_tokens``.
        page_table: int32 ``[num_entries]`` — flat page ids (a flattened block table or ``kv_indices``).
        page_table_start: int32 ``[batch]`` — index into ``page_table`` of each request's first page.
        page_size: tokens per page (``kv_cache.shape[1]``), a positive power of two (host int).
        q_len: queries per request when every request has the same number (decode: 1, MTP: 1 + drafts; at most
            ``MAX_Q_LEN``), else ``None`` (ragged; only the reference implementation accepts that). Host int, so
            kernels can specialise on it without a device sync.
        max_kv_len: optional host-side upper bound of ``kv_lens`` (used only to size work; never required).
        plan: the split-KV work plan, filled lazily by :func:`mla_backend.planner.plan_split_kv`
            (or ahead of time by an engine adapter into persistent CUDA-graph buffers).
        source: what the constructor was given (:class:`MetadataSource`), for the value checks; ``None`` when the
            fields were set directly (then each request is only held to the bounds of ``page_table``).
    """

    kv_lens: torch.Tensor
    qo_indptr: torch.Tensor
    page_table: torch.Tensor
    page_table_start: torch.Tensor
    page_size: int
    q_len: int | None = 1
    max_kv_len: int | None = None
    plan: object | None = field(default=None, repr=False)
    source: MetadataSource | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Host values only (no device access): a few hundred ns per construction, none per mla_decode call.
        self.page_size = check_page_size(self.page_size, "page_size")
        self.q_len = check_q_len(self.q_len, "q_len", allow_none=True)
        if self.max_kv_len is not None:
            self.max_kv_len = _host_int(self.max_kv_len, "max_kv_len", "a non-negative int or None", minimum=0)

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
                (only ``stride(1) == 1`` is required). Each request's ``seq_lens`` must fit its own row:
                ``ceil(seq_lens[r] / page_size) <= max_pages`` (checked by ``mla_decode`` with ``check_indices``).
            seq_lens: int32 ``[batch]`` KV lengths including the new tokens (int64 is converted to int32).
            page_size: tokens per page (vLLM's kernel block size), a positive power of two.
            q_len: queries per request when uniform (default 1 without ``qo_indptr``); with ``qo_indptr``
                give it too when the counts are uniform, else the batch counts as ragged (reference only).
            qo_indptr: optional int32 ``[batch + 1]`` query offsets (int64 is converted).
        """
        page_size = check_page_size(page_size, "page_size")
        q_len = check_q_len(q_len, "q_len", allow_none=True)
        _require(isinstance(block_table, torch.Tensor), "block_table", f"must be a tensor, got {_typename(block_table)}")
        _require(block_table.dim() == 2, "block_table",
                 f"must be 2-D [batch, max_pages], got shape {tuple(block_table.shape)}")
        _require(block_table.dtype == INDEX_DTYPE, "block_table", f"must be int32, got {block_table.dtype}")
        batch = block_table.shape[0]
        device = block_table.device
        seq_lens = _index_tensor(seq_lens, "seq_lens", (batch,), f"[batch={batch}]", device, "block_table")
        if block_table.stride(1) != 1 and block_table.shape[1] > 1:
            block_table = block_table.contiguous()
        row_stride = block_table.stride(0) if block_table.shape[1] > 0 else 0
        # A flat view of the storage the rows live in: [batch - 1] * stride + max_pages entries.
        flat_len = (batch - 1) * row_stride + block_table.shape[1] if batch > 0 else 0
        page_table = block_table.as_strided((flat_len,), (1,))
        start = torch.arange(batch, dtype=INDEX_DTYPE, device=device) * row_stride
        qo_indptr, q_len = _queries(qo_indptr, q_len, batch, device, "block_table")
        return cls(seq_lens, qo_indptr, page_table, start, page_size, q_len, max_kv_len,
                   source=MetadataSource("block_table", row_pages=block_table.shape[1]))

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
            kv_indptr: int32 ``[batch + 1]`` offsets into ``kv_indices`` (in pages), non-decreasing from 0
                (int64 is converted). Request ``r`` owns ``kv_indices[kv_indptr[r] : kv_indptr[r + 1]]``.
            kv_indices: int32 ``[>= kv_indptr[-1]]`` page ids.
            page_size: tokens per page, a positive power of two.
            kv_last_page_len: int32 ``[batch]`` tokens used in each request's last page (FlashInfer
                convention, ``1..page_size``; ``0..page_size`` for a request with no page). Give this or ``kv_lens``.
            kv_lens: int32 ``[batch]`` KV lengths (SGLang's ``seq_lens``), alternative to ``kv_last_page_len``;
                ``ceil(kv_lens[r] / page_size)`` must not exceed ``kv_indptr[r + 1] - kv_indptr[r]``.
            qo_indptr: optional int32 ``[batch + 1]``; default ``arange(batch + 1) * q_len``.
            q_len: queries per request when uniform (default 1 without ``qo_indptr``; ragged if omitted with it).
        """
        page_size = check_page_size(page_size, "page_size")
        q_len = check_q_len(q_len, "q_len", allow_none=True)
        _require(isinstance(kv_indptr, torch.Tensor), "kv_indptr", f"must be a tensor, got {_typename(kv_indptr)}")
        _require(kv_indptr.dim() == 1 and kv_indptr.shape[0] >= 1, "kv_indptr",
                 f"must be 1-D [batch + 1], got shape {tuple(kv_indptr.shape)}")
        device = kv_indptr.device
        batch = kv_indptr.shape[0] - 1
        indptr = _index_tensor(kv_indptr, "kv_indptr", (batch + 1,), f"[batch + 1={batch + 1}]", device, "kv_indptr")
        _require(isinstance(kv_indices, torch.Tensor), "kv_indices", f"must be a tensor, got {_typename(kv_indices)}")
        _require(kv_indices.dim() == 1, "kv_indices", f"must be 1-D, got shape {tuple(kv_indices.shape)}")
        _require(kv_indices.dtype == INDEX_DTYPE, "kv_indices", f"must be int32, got {kv_indices.dtype}")
        _require(kv_indices.device == device, "kv_indices", f"is on {kv_indices.device}, kv_indptr on {device}")
        _require(kv_lens is None or kv_last_page_len is None, "kv_last_page_len",
                 "and kv_lens were both given; give one of them")
        last = None
        if kv_lens is None:
            _require(kv_last_page_len is not None, "kv_last_page_len", "or kv_lens must be given")
            last = _index_tensor(kv_last_page_len, "kv_last_page_len", (batch,), f"[batch={batch}]", device, "kv_indptr")
            num_pages = indptr[1:] - indptr[:-1]
            kv_lens = torch.where(num_pages > 0, (num_pages - 1) * page_size + last, torch.zeros_like(num_pages))
        else:
            kv_lens = _index_tensor(kv_lens, "kv_lens", (batch,), f"[batch={batch}]", device, "kv_indptr")
        qo_indptr, q_len = _queries(qo_indptr, q_len, batch, device, "kv_indptr")
        return cls(kv_lens, qo_indptr, kv_indices, indptr[:-1], page_size, q_len, max_kv_len,
                   source=MetadataSource("csr", kv_indptr=indptr, kv_last_page_len=last))

    # ------------------------------------------------------------------ helpers
    def num_pages(self) -> torch.Tensor:
        """int32 ``[batch]`` pages each request uses."""
        return (self.kv_lens + self.page_size - 1) // self.page_size

    def check(self, num_cache_pages: int | None = None, num_tokens: int | None = None) -> None:
        """The value checks of ``mla_decode(check_indices=True)`` (a device sync): raises :class:`MLAInputError`.

        ``num_cache_pages`` (the cache's ``shape[0]``) bounds the page ids; ``num_tokens`` (q's ``shape[0]``) the
        query offsets. Either may be omitted.
        """
        from .validation import check_metadata_values

        check_metadata_values(self, num_tokens, num_cache_pages)

    def to(self, device: torch.device | str) -> "MLADecodeMetadata":
        move = lambda t: t.to(device)  # noqa: E731
        return MLADecodeMetadata(move(self.kv_lens), move(self.qo_indptr), move(self.page_table),
                                 move(self.page_table_start), self.page_size, self.q_len, self.max_kv_len,
                                 source=None if self.source is None else self.source.to(device))


# ---------------------------------------------------------------------- checks of host values and tensor kinds
def _require(ok: bool, arg: str, msg: str) -> None:
    if not ok:
        raise MLAInputError(f"{arg} {msg}")


def _typename(x) -> str:
    return type(x).__name__


def _host_int(value, arg: str, supported: str, minimum: int | None = None) -> int:
    # numbers.Integral: python and numpy ints; not bool (an int subclass), not floats, not tensors (a device read)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (minimum is not None and value < minimum):
        raise MLAInputError(f"{arg}={value!r} ({_typename(value)}) is not supported; expected {supported}")
    return int(value)


def check_page_size(value, arg: str = "page_size") -> int:
    """A positive power of two (host int, not bool); returns it as a python int."""
    supported = "a positive power of two (python int), e.g. 1, 16, 64"
    size = _host_int(value, arg, supported, minimum=1)
    if size & (size - 1):
        raise MLAInputError(f"{arg}={value!r} is not supported; expected {supported}")
    return size


def check_q_len(value, arg: str = "q_len", allow_none: bool = False) -> int | None:
    """An int in ``1..MAX_Q_LEN`` (or ``None`` where the batch may be ragged)."""
    if value is None and allow_none:
        return None
    supported = f"an int in 1..{MAX_Q_LEN} (queries per request: decode plus up to {MAX_Q_LEN - 1} drafts)" + (
        ", or None for ragged counts given by qo_indptr" if allow_none else "")
    q_len = _host_int(value, arg, supported, minimum=1)
    if q_len > MAX_Q_LEN:
        raise MLAInputError(f"{arg}={value!r} is not supported; expected {supported}")
    return q_len


def _index_tensor(t, arg: str, shape: tuple, shape_text: str, device, device_of: str) -> torch.Tensor:
    """An int32 tensor of ``shape`` on ``device``: int32 as is (no copy), int64 converted; anything else refused."""
    _require(isinstance(t, torch.Tensor), arg, f"must be a tensor, got {_typename(t)}")
    _require(tuple(t.shape) == tuple(shape), arg, f"must be {shape_text}, got shape {tuple(t.shape)}")
    _require(t.dtype == INDEX_DTYPE or t.dtype in _CONVERTED_DTYPES, arg,
             f"must be an int32 tensor (int64 is converted), got {t.dtype}")
    _require(t.device == device, arg, f"is on {t.device}, {device_of} on {device}; expected one device")
    return t if t.dtype == INDEX_DTYPE else t.to(INDEX_DTYPE)


def _queries(qo_indptr, q_len, batch: int, device, device_of: str) -> tuple[torch.Tensor, int | None]:
    if qo_indptr is None:
        q_len = 1 if q_len is None else q_len
        return torch.arange(batch + 1, dtype=INDEX_DTYPE, device=device) * q_len, q_len
    return _index_tensor(qo_indptr, "qo_indptr", (batch + 1,), f"[batch + 1={batch + 1}]", device, device_of), q_len
