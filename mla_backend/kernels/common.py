"""Helpers shared by the TileLang decode kernels: the split kernel's signature, tile counts, the segment epilogue,
the plan's request walk."""

import inspect
from typing import Any, NamedTuple

import tilelang.language as T

from ..constants import HEAD_DIM, KV_LORA_RANK, ROPE_DIM

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# TileLang 0.1.15 turned UnrollLoop's explicit_unroll default off: a T.unroll loop stays a "#pragma unroll" loop. The
# epilogue that InjectSoftwarePipeline emits after a loop with a runtime trip count is such a loop, and its
# cp.async.wait_group counts depend on the epilogue index, which CUDA codegen needs as constants ("Downcast from
# tirx.Sub to ir.IntImm failed"). A pipelined loop's annotations are copied onto the loops it becomes: ask for
# explicit unrolling (what TileLang <= 0.1.12 always did; their T.Pipelined takes no annotations).
PIPELINE_KWARGS = ({"annotations": {"pragma_unroll_explicit": 1}}
                   if "annotations" in inspect.signature(T.Pipelined).parameters else {})


def pipelined(extent, num_stages: int):
    """``T.Pipelined(extent, num_stages)`` whose epilogue is unrolled explicitly on every TileLang."""
    return T.Pipelined(extent, num_stages=num_stages, **PIPELINE_KWARGS)


class SplitDims(NamedTuple):
    """The split kernel's symbolic sizes (runtime values: one compile per variant serves every batch)."""

    num_tokens: Any  # query tokens of the batch
    batch: Any  # requests
    num_pages: Any  # pages of the KV cache
    num_entries: Any  # page-table entries
    num_parts: Any  # the plan's parts (one program column each)
    num_slots: Any  # partial slots
    num_req_entries: Any  # entries of the plan's per-request part table (2 per request of the planner's max batch)


def split_dims() -> SplitDims:
    """Fresh symbolic sizes for one split kernel, each named as its field."""
    return SplitDims(*(T.dynamic(name) for name in SplitDims._fields))


def split_prim_func(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str, dims: SplitDims,
                    program):
    """The split kernel's prim_func ``mla_decode_split``, whose body is the macro ``program`` called with every
    argument (in this order), so every architecture's kernel has the same name and arguments.

    Arguments (all device tensors; ``H`` = ``num_heads``, the other sizes ``dims``'):
        q_nope ``[num_tokens, H, 512]``, q_pe ``[num_tokens, H, 64]`` (``dtype``, runtime token and head strides);
        kv_cache ``[num_pages, page_size, 576]`` (``kv_dtype``); k_scale fp32 ``[1]``;
        page_table int32 ``[num_entries]``; page_table_start, kv_lens int32 ``[batch]``;
        qo_indptr int32 ``[batch + 1]``; cu_blocks int32 ``[batch + 1]`` (the planner's blocks);
        part_begin_req, part_end_req int32 ``[num_parts]``; part_start int32 ``[num_parts + 1]`` (the flat block
        where each part starts, the last entry the total); req_parts int32 ``[num_req_entries]`` (request r's first
        part at ``2 r``, its number of parts at ``2 r + 1``); sm_scale fp32 ``[1]``;
        out ``[num_tokens, H, 512]`` (``dtype``); lse fp32 ``[num_tokens, H]`` (natural log);
        out_partial fp32 ``[num_slots, H * q_len, 512]``; lse_partial fp32 ``[num_slots, H * q_len]`` (log2).
    """
    num_tokens, batch, num_pages, num_entries, num_parts, num_slots, num_req_entries = dims
    rows = num_heads * q_len
    accum = "float32"
    # q halves are read in place from whatever views the engine hands over (vLLM's q_nope is a transposed bmm
    # output, a 576-wide q gives two strided slices): strides are runtime values (the op guarantees 16-byte aligned
    # rows, for sm90's cp.async).
    q_nope_stride = (T.dynamic("q_nope_stride_t"), T.dynamic("q_nope_stride_h"), 1)
    q_pe_stride = (T.dynamic("q_pe_stride_t"), T.dynamic("q_pe_stride_h"), 1)

    @T.prim_func
    def mla_decode_split(
        q_nope: T.StridedTensor([num_tokens, num_heads, KV_LORA_RANK], q_nope_stride, dtype),
        q_pe: T.StridedTensor([num_tokens, num_heads, ROPE_DIM], q_pe_stride, dtype),
        kv_cache: T.Tensor([num_pages, page_size, HEAD_DIM], kv_dtype),
        k_scale: T.Tensor([1], accum),
        page_table: T.Tensor([num_entries], "int32"),
        page_table_start: T.Tensor([batch], "int32"),
        kv_lens: T.Tensor([batch], "int32"),
        qo_indptr: T.Tensor([batch + 1], "int32"),
        cu_blocks: T.Tensor([batch + 1], "int32"),
        part_begin_req: T.Tensor([num_parts], "int32"),
        part_end_req: T.Tensor([num_parts], "int32"),
        part_start: T.Tensor([num_parts + 1], "int32"),
        req_parts: T.Tensor([num_req_entries], "int32"),
        sm_scale: T.Tensor([1], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
    ):
        program(q_nope, q_pe, kv_cache, k_scale, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                part_begin_req, part_end_req, part_start, req_parts, sm_scale, out, lse, out_partial, lse_partial)

    return mla_decode_split


def num_row_blocks(num_heads: int, q_len: int, block_rows: int) -> int:
    return -(-num_heads * q_len // block_rows)


class SegmentStore(NamedTuple):
    """A segment epilogue's macros: ``normalize`` (acc by l and the fp8 scale, one factor per row), ``write`` (the
    normalised tile to ``out`` / ``lse`` or to a partial slot) and ``store`` (both, dividing each element)."""

    normalize: Any
    write: Any
    store: Any


def make_store_rows(num_heads: int, q_len: int, block_rows: int, ncols: int, col0: int = 0,
                    with_lse: bool = True) -> SegmentStore:
    """Segment epilogue shared by the decode kernels: normalise ``acc`` (columns ``col0 .. col0 + ncols``
    of 512) by ``l_sum`` and the fp8 scale, then write the tile's rows to ``out`` / ``lse`` when the part
    holds the whole request (``direct``), else to partial slot ``slot`` (log2-domain LSE). Rows past
    ``num_heads * q_len`` are padding and never stored. Stored straight from registers: a shared staging
    tile would not fit beside the KV stages."""
    rows = num_heads * q_len
    accum = "float32"

    @T.macro
    def normalize(acc, l_sum, kv_scale, factor):
        """acc *= kv_scale / l_sum per row (0 where l_sum is 0), through the row vector ``factor``."""
        for i in T.Parallel(block_rows):
            factor[i] = T.if_then_else(l_sum[i] == 0, 0, kv_scale / l_sum[i])
        for i, d in T.Parallel(block_rows, ncols):
            acc[i, d] *= factor[i]

    @T.macro
    def write(acc, l_sum, m_cur, direct, slot, tok0, row0, out, lse, out_partial, lse_partial):
        if direct:
            for i, d in T.Parallel(block_rows, ncols):
                if row0 + i < rows:
                    out[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, col0 + d] = acc[i, d]
            if with_lse:
                for i in T.Parallel(block_rows):
                    if row0 + i < rows:
                        lse[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads] = T.if_then_else(
                            l_sum[i] == 0, -T.infinity(accum), (T.log2(l_sum[i]) + m_cur[i]) * LN2)
        else:
            for i, d in T.Parallel(block_rows, ncols):
                if row0 + i < rows:
                    out_partial[slot, row0 + i, col0 + d] = acc[i, d]
            if with_lse:
                for i in T.Parallel(block_rows):
                    if row0 + i < rows:
                        lse_partial[slot, row0 + i] = partial_lse(l_sum[i], m_cur[i])

    @T.macro
    def store(acc, l_sum, m_cur, kv_scale, direct, slot, tok0, row0, out, lse, out_partial, lse_partial):
        for i, d in T.Parallel(block_rows, ncols):
            acc[i, d] = T.if_then_else(l_sum[i] == 0, 0, acc[i, d] * kv_scale / l_sum[i])
        write(acc, l_sum, m_cur, direct, slot, tok0, row0, out, lse, out_partial, lse_partial)

    return SegmentStore(normalize, write, store)


def request_parts(req_parts, req):
    """(first part, number of parts) of request ``req`` in the planner's cut (its table ``req_parts``); its partial
    from part ``p`` is in slot ``p + req``."""
    return req_parts[2 * req], req_parts[2 * req + 1]


@T.macro
def wait_for_inputs(pdl: bool):
    """``KernelConfig.pdl`` (sm90): wait until the stream's previous kernel has finished and its writes are visible
    (griddepcontrol.wait; it returns at once where this launch did not start early) before any read of what that
    kernel may have written. Nothing where ``pdl`` is off (gfx942 has no such launch)."""
    if pdl:
        T.evaluate(T.pdl_sync())


def partial_lse(l_sum, m_cur):
    """A part's log2-domain LSE of a row (its partial slot's): -inf where the row saw nothing.

    Every guard on a softmax sum here tests ``== 0``, not ``> 0``: a NaN sum (NaN in q or in a visible cache row)
    must reach the output and the LSE as NaN, as it does in the reference and the anchors, not read as "nothing
    visible" (-inf), which an LSE merge across ranks would silently drop."""
    return T.if_then_else(l_sum == 0, -T.infinity("float32"), T.log2(l_sum) + m_cur)


@T.macro
def request_inputs(kv_lens, qo_indptr, page_table_start, req):
    """What a loader of Q and KV needs of request ``req``: its KV length, its first query token and its first
    page-table entry, as let-bound values."""
    kv_len = kv_lens[req]
    tok0 = qo_indptr[req]
    pt0 = page_table_start[req]
    return kv_len, tok0, pt0


@T.macro
def segment_span(cu_blocks, req, part_lo, part_hi):
    """A part's segment of request ``req``: its flat blocks ``[req_lo, req_hi)`` and the segment's blocks
    ``[blk_lo, blk_hi)`` of the request (empty where ``blk_hi <= blk_lo``), as let-bound values."""
    req_lo = cu_blocks[req]
    req_hi = cu_blocks[req + 1]
    blk_lo = T.max(part_lo, req_lo) - req_lo
    blk_hi = T.min(part_hi, req_hi) - req_lo
    return req_lo, req_hi, blk_lo, blk_hi
