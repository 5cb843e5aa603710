"""Input checks for :func:`mla_backend.mla_decode`: each error names the argument, the value and what is supported."""

from __future__ import annotations

import math

import torch

from .metadata import INDEX_DTYPE, MLADecodeMetadata

KV_LORA_RANK, ROPE_DIM = 512, 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))
KV_DTYPES = Q_DTYPES + FP8_DTYPES


class MLAInputError(ValueError):
    """Invalid argument to the MLA decode op."""


def fail(arg: str, value, supported: str) -> None:
    raise MLAInputError(f"mla_decode: {arg}={value} is not supported; expected {supported}")


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


def check_scales(softmax_scale, k_scale) -> None:
    """The softmax scale (and a host k_scale) must be finite and positive: the Hopper kernel takes S's row max before
    it applies the scale (max(c s) = c max(s) only for c > 0). A k_scale tensor is not read on the host (no sync)."""
    for name, value in (("softmax_scale", softmax_scale), ("k_scale", k_scale)):
        if name == "k_scale" and (value is None or isinstance(value, torch.Tensor)):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            number = math.nan
        if isinstance(value, (bool, str, bytes)) or not math.isfinite(number) or number <= 0:
            fail(name, repr(value), "a finite positive float" + (" or an fp32 device tensor" if name == "k_scale" else ""))


def check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata,
                 out: torch.Tensor | None, check_indices: bool) -> None:
    if q_nope.dtype not in Q_DTYPES:
        fail("q.dtype", q_nope.dtype, "float16, bfloat16 or float32")
    if kv_cache.dtype not in KV_DTYPES:
        fail("kv_cache.dtype", kv_cache.dtype, "float16, bfloat16, float32 or float8_e4m3fn")
    if kv_cache.dtype not in FP8_DTYPES and kv_cache.dtype != q_nope.dtype:
        fail("kv_cache.dtype", kv_cache.dtype, f"the query dtype ({q_nope.dtype}) or an fp8 cache")
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


def check_metadata_values(metadata: MLADecodeMetadata, num_tokens: int, num_pages: int) -> None:
    """Value checks that read the metadata on the host (a device sync: not for CUDA-graph capture)."""
    kv_lens = metadata.kv_lens.cpu()
    qo = metadata.qo_indptr.cpu()
    if kv_lens.shape[0]:
        if int(kv_lens.min()) < 0:
            fail("metadata.kv_lens", f"min {int(kv_lens.min())}", "non-negative lengths")
        q_lens = qo[1:] - qo[:-1]
        if int(qo[0]) != 0 or int(q_lens.min()) < 0 or int(qo[-1]) != num_tokens:
            fail("metadata.qo_indptr", qo.tolist()[:8], f"non-decreasing offsets from 0 to num_tokens={num_tokens}")
    num_used = (kv_lens + metadata.page_size - 1) // metadata.page_size
    starts = metadata.page_table_start.cpu()
    ends = starts + num_used
    used = num_used > 0
    if bool(used.any()):
        if int(starts[used].min()) < 0 or int(ends[used].max()) > metadata.page_table.shape[0]:
            fail("metadata.page_table_start", "a request whose pages run past page_table",
                 f"start + ceil(kv_len / page_size) <= len(page_table) = {metadata.page_table.shape[0]}")
        idx = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(starts[used], ends[used])])
        pages = metadata.page_table.cpu()[idx]
        if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
            bad = int(pages[(pages < 0) | (pages >= num_pages)][0])
            fail("metadata.page_table", f"entry {bad}", f"page ids in [0, num_pages={num_pages})")
