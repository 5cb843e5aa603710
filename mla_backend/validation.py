"""Input checks for :func:`mla_backend.mla_decode`: each error names the argument, the value and what is supported."""

from __future__ import annotations

import math

import torch

from .constants import HEAD_DIM, KV_LORA_RANK, ROPE_DIM
from .metadata import INDEX_DTYPE, MLADecodeMetadata, MLAInputError, check_page_size, check_q_len

__all__ = ["FP8_DTYPES", "HEAD_DIM", "KV_DTYPES", "KV_LORA_RANK", "MLAInputError", "Q_DTYPES", "ROPE_DIM",
           "check_inputs", "check_metadata_values", "check_scales", "fail", "normalize_kv_cache", "split_query"]
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp8 caches the op takes (the reference reads both; the kernels each take their GPU's: dispatch.FP8_KV_DTYPES)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))
KV_DTYPES = Q_DTYPES + FP8_DTYPES


def fail(arg: str, value, supported: str, caller: str = "mla_decode") -> None:
    raise MLAInputError(f"{caller}: {arg}={value} is not supported; expected {supported}")


def split_query(q) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts ``q [T, H, 576]`` or the pair ``(q_nope [T, H, 512], q_pe [T, H, 64])``; returns views."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            fail("q", f"a sequence of {len(q)} tensors", "q [T, H, 576] or (q_nope [T, H, 512], q_pe [T, H, 64])")
        q_nope, q_pe = q
        if q_nope.dim() != 3 or q_nope.shape[-1] != KV_LORA_RANK:
            fail("q_nope.shape", tuple(q_nope.shape), "[num_tokens, num_heads, 512]")
        if q_pe.dim() != 3 or q_pe.shape[-1] != ROPE_DIM or q_pe.shape[:2] != q_nope.shape[:2]:
            fail("q_pe.shape", tuple(q_pe.shape), f"[{q_nope.shape[0]}, {q_nope.shape[1]}, 64] (matching q_nope)")
        if q_pe.dtype != q_nope.dtype:
            fail("q_pe.dtype", q_pe.dtype, f"the dtype of q_nope ({q_nope.dtype})")
        return q_nope, q_pe
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        fail("q.shape", tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__,
             "[num_tokens, num_heads, 576] (head dim 576 = 512 latent + 64 rope)")
    return q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]


def normalize_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_pages, page_size, 576]``; also accepts FlashMLA's ``[num_pages, page_size, 1, 576]``."""
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache.squeeze(2)
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != HEAD_DIM:
        fail("kv_cache.shape", tuple(kv_cache.shape), "[num_pages, page_size, 576] (512 latent c_kv + 64 k_pe)")
    return kv_cache


def check_scales(softmax_scale, k_scale, device: torch.device | None = None, caller: str = "mla_decode") -> None:
    """The softmax scale (and a host k_scale) must be finite and positive: the Hopper kernel takes S's row max before
    it applies the scale (max(c s) = c max(s) only for c > 0). A k_scale tensor is not read on the host (no sync): only
    its size, dtype and device are checked."""
    for name, value in (("softmax_scale", softmax_scale), ("k_scale", k_scale)):
        if name == "k_scale" and value is None:
            continue
        if name == "k_scale" and isinstance(value, torch.Tensor):
            if value.numel() != 1 or not value.dtype.is_floating_point or (device is not None and value.device != device):
                fail("k_scale", f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}",
                     f"one float (a finite positive float, or a 1-element fp32 tensor on {device or 'the device of q'})",
                     caller)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            number = math.nan
        if isinstance(value, (bool, str, bytes)) or not math.isfinite(number) or number <= 0:
            fail(name, repr(value), "a finite positive float" + (" or an fp32 device tensor" if name == "k_scale" else ""),
                 caller)


def check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata,
                 out: torch.Tensor | None, check_indices: bool) -> None:
    """Shapes, dtypes and devices (host attributes only); with ``check_indices`` also the metadata's values
    (:func:`check_metadata_values`, a device sync)."""
    if not isinstance(metadata, MLADecodeMetadata):
        fail("metadata", f"a {type(metadata).__module__}.{type(metadata).__qualname__}",
             "an MLADecodeMetadata (MLADecodeMetadata.from_block_table or MLADecodeMetadata.from_csr)")
    if q_nope.dtype not in Q_DTYPES:
        fail("q.dtype", q_nope.dtype, "float16, bfloat16 or float32")
    if kv_cache.dtype not in KV_DTYPES:
        fail("kv_cache.dtype", kv_cache.dtype, "float16, bfloat16, float32, float8_e4m3fn (sm90) or float8_e4m3fnuz "
             "(gfx942)")
    if kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != q_nope.dtype:
        fail("kv_cache.dtype", kv_cache.dtype, f"the query dtype ({q_nope.dtype}) or an fp8 cache")
    if check_indices:  # host values a caller may have overwritten after construction (cheap, but not on the hot path)
        check_page_size(metadata.page_size, "metadata.page_size")
        check_q_len(metadata.q_len, "metadata.q_len", allow_none=True)
    if kv_cache.shape[1] != metadata.page_size:
        fail("metadata.page_size", metadata.page_size, f"kv_cache.shape[1] ({kv_cache.shape[1]})")
    devices = {"q": q_nope.device, "kv_cache": kv_cache.device, "metadata.kv_lens": metadata.kv_lens.device,
               "metadata.page_table": metadata.page_table.device, "metadata.qo_indptr": metadata.qo_indptr.device,
               "metadata.page_table_start": metadata.page_table_start.device}
    if len(set(devices.values())) != 1:
        fail("devices", ", ".join(f"{k} on {v}" for k, v in devices.items()), "all tensors on one device")
    for name in ("kv_lens", "qo_indptr", "page_table", "page_table_start"):
        t = getattr(metadata, name)
        if t.dtype != INDEX_DTYPE:
            fail(f"metadata.{name}.dtype", t.dtype, "int32")
    batch = metadata.batch_size
    if metadata.qo_indptr.shape != (batch + 1,):
        fail("metadata.qo_indptr.shape", tuple(metadata.qo_indptr.shape), f"[batch + 1] = [{batch + 1}]")
    if metadata.page_table_start.shape != (batch,):
        fail("metadata.page_table_start.shape", tuple(metadata.page_table_start.shape), f"[batch] = [{batch}]")
    num_tokens = q_nope.shape[0]
    if metadata.q_len is not None and num_tokens != batch * metadata.q_len:
        fail("q.shape[0]", num_tokens, f"batch * q_len = {batch} * {metadata.q_len} = {batch * metadata.q_len}")
    if out is not None:
        want = (num_tokens, q_nope.shape[1], KV_LORA_RANK)
        if tuple(out.shape) != want or out.dtype != q_nope.dtype or out.device != q_nope.device:
            fail("out", f"{tuple(out.shape)} {out.dtype} on {out.device}", f"{want} {q_nope.dtype} on {q_nope.device}")
    if check_indices:
        check_metadata_values(metadata, num_tokens, kv_cache.shape[0])


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _head(t: torch.Tensor, n: int = 8) -> str:
    values = t.tolist()
    return str(values[:n])[:-1] + ", ...]" if len(values) > n else str(values)


def check_metadata_values(metadata: MLADecodeMetadata, num_tokens: int | None = None,
                          num_pages: int | None = None) -> None:
    """Every check of the metadata's values, in one place (it reads the metadata on the host: a device sync, so not
    for CUDA-graph capture; ``mla_decode`` runs it when ``check_indices`` is on).

    * ``page_size`` a positive power of two and ``q_len`` in ``1..MAX_Q_LEN`` or ``None`` (host ints);
    * ``qo_indptr`` non-decreasing from 0 to ``num_tokens``, and ``q_len`` queries per request when ``q_len`` is set;
    * ``kv_lens`` non-negative, and each request within its own pages: at most the block table's row width
      (``from_block_table``), or ``kv_indptr[r + 1] - kv_indptr[r]`` pages (``from_csr``);
    * ``kv_indptr`` non-decreasing from 0 and ``kv_last_page_len`` in ``1..page_size`` (``0..page_size`` for a
      request with no page) (``from_csr``);
    * the pages a request uses lie inside ``page_table``, and their ids in ``[0, num_pages)``.
    """
    md = metadata
    page_size = check_page_size(md.page_size, "metadata.page_size")
    q_len = check_q_len(md.q_len, "metadata.q_len", allow_none=True)
    batch = md.batch_size
    if md.qo_indptr.shape != (batch + 1,) or md.page_table_start.shape != (batch,):
        fail("metadata", f"qo_indptr {tuple(md.qo_indptr.shape)}, page_table_start {tuple(md.page_table_start.shape)}",
             f"[batch + 1] = [{batch + 1}] and [batch] = [{batch}]")
    # int64 on the host: sums of int32 offsets cannot wrap
    kv_lens = md.kv_lens.cpu().long()
    qo = md.qo_indptr.cpu().long()
    starts = md.page_table_start.cpu().long()
    counts = qo[1:] - qo[:-1]
    if int(qo[0]) != 0 or (batch and int(counts.min()) < 0) or (num_tokens is not None and int(qo[-1]) != num_tokens):
        fail("metadata.qo_indptr", _head(qo),
             "non-decreasing offsets from 0" + (f" to num_tokens={num_tokens}" if num_tokens is not None else ""))
    if q_len is not None and batch and bool((counts != q_len).any()):
        r = _first(counts != q_len)
        fail("metadata.qo_indptr", f"{_head(qo)} (request {r} has {int(counts[r])} queries)",
             f"arange(batch + 1) * q_len for q_len={q_len} (the kernels take the same number of queries per "
             "request; q_len=None marks ragged counts, reference only)")
    used_pages = (kv_lens + page_size - 1) // page_size
    source = md.source
    if source is not None and source.layout == "block_table":
        over = used_pages > source.row_pages
        if bool(over.any()):
            r = _first(over)
            fail(f"metadata.kv_lens[{r}]", f"{int(kv_lens[r])} (seq_lens of from_block_table)",
                 f"at most {source.row_pages * page_size} tokens: the request's own block_table row of "
                 f"{source.row_pages} pages x page_size {page_size} (a longer length would read past its row)")
    elif source is not None and source.layout == "csr":
        indptr = source.kv_indptr.cpu().long()
        span = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or (batch and int(span.min()) < 0):
            fail("kv_indptr", _head(indptr), "offsets non-decreasing from 0 (request r owns "
                 "kv_indices[kv_indptr[r] : kv_indptr[r + 1]])")
        if source.kv_last_page_len is not None:
            last = source.kv_last_page_len.cpu().long()
            bad = (last < (span > 0).long()) | (last > page_size)
            if bool(bad.any()):
                r = _first(bad)
                fail(f"kv_last_page_len[{r}]", int(last[r]),
                     f"1..page_size={page_size} tokens in the last page (0..{page_size} for a request with no page; "
                     f"request {r} has {int(span[r])})")
        over = used_pages > span
        if bool(over.any()):
            r = _first(over)
            fail(f"metadata.kv_lens[{r}]", f"{int(kv_lens[r])} (kv_lens of from_csr)",
                 f"at most {int(span[r]) * page_size} tokens: ceil(kv_len / page_size={page_size}) pages must fit the "
                 f"request's own kv_indptr[{r + 1}] - kv_indptr[{r}] = {int(span[r])} pages")
    if batch and int(kv_lens.min()) < 0:
        r = _first(kv_lens < 0)
        fail(f"metadata.kv_lens[{r}]", int(kv_lens[r]), "non-negative lengths")
    used = used_pages > 0
    if not bool(used.any()):
        return
    ends = starts + used_pages
    if int(starts[used].min()) < 0 or int(ends[used].max()) > md.page_table.shape[0]:
        r = _first(used & ((starts < 0) | (ends > md.page_table.shape[0])))
        fail("metadata.page_table_start", f"a request whose pages run past page_table (request {r}: entries "
             f"{int(starts[r])}..{int(ends[r]) - 1})",
             f"0 <= start and start + ceil(kv_len / page_size) <= len(page_table) = {md.page_table.shape[0]}")
    # the page ids each request reads, gathered on the device (the table itself may be large)
    n = used_pages[used]
    first = torch.cumsum(n, 0) - n
    offsets = torch.repeat_interleave(starts[used] - first, n) + torch.arange(int(n.sum()))
    pages = md.page_table[offsets.to(md.page_table.device)].cpu().long()
    bad = (pages < 0) if num_pages is None else (pages < 0) | (pages >= num_pages)
    if bool(bad.any()):
        i = _first(bad)
        request = int(used.nonzero()[:, 0][int(torch.searchsorted(torch.cumsum(n, 0), torch.tensor([i]), right=True)[0])])
        fail("metadata.page_table", f"entry {int(pages[i])} (read by request {request})",
             f"page ids in [0, num_pages={num_pages})" if num_pages is not None else "non-negative page ids")
