"""TileLang MLA decode: paged, split-KV, s_q x heads folded into 64-row tiles.

One program per (work part, row block). A "part" is a contiguous run of the flattened
(request, 64-token KV block) work list, cut by the split-KV planner so every part gets about the same
number of blocks whatever the lengths. A part walks the requests it touches; a request segment that
covers the whole request writes ``out``/``lse`` directly, otherwise it writes an fp32 partial into
slot ``part + request`` (unique along the walk) and the combine program merges the slots by LSE.

Rows of a tile are ``(query i, head h)`` pairs, ``row = i * num_heads + h`` — the memory order of
``q[request tokens]`` — so s_q > 1 (MTP) reuses each KV block for all its queries.

Every shape that changes per step (tokens, batch, pages, page-table entries, parts) is symbolic: one
compile per (dtype, num_heads, q_len, page_size, arch, config) serves every batch.
"""

import inspect
from typing import Any, NamedTuple

import tilelang.language as T

from .configs import MAX_PARTS, KernelConfig

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
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
            factor[i] = T.if_then_else(l_sum[i] > 0, kv_scale / l_sum[i], 0)
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
                            l_sum[i] > 0, (T.log2(l_sum[i]) + m_cur[i]) * LN2, -T.infinity(accum))
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
            acc[i, d] = T.if_then_else(l_sum[i] > 0, acc[i, d] * kv_scale / l_sum[i], 0)
        write(acc, l_sum, m_cur, direct, slot, tok0, row0, out, lse, out_partial, lse_partial)

    return SegmentStore(normalize, write, store)


def request_parts(req_lo, req_hi, width):
    """(first part, number of parts) of a request covering flat blocks ``[req_lo, req_hi)`` with ``width``-block
    parts (the planner's cut); its partial from part ``p`` is in slot ``p + req``."""
    first = req_lo // width
    return first, (req_hi - 1) // width - first + 1


@T.macro
def wait_for_inputs(pdl: bool):
    """``KernelConfig.pdl`` (sm90): wait until the stream's previous kernel has finished and its writes are visible
    (griddepcontrol.wait; it returns at once where this launch did not start early) before any read of what that
    kernel may have written. Nothing where ``pdl`` is off (gfx942 has no such launch)."""
    if pdl:
        T.evaluate(T.pdl_sync())


def partial_lse(l_sum, m_cur):
    """A part's log2-domain LSE of a row (its partial slot's): -inf where the row saw nothing."""
    return T.if_then_else(l_sum > 0, T.log2(l_sum) + m_cur, -T.infinity("float32"))


def build_decode_kernel(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                        cfg: KernelConfig):
    """Returns the split-KV prim_func.

    Arguments of the returned function (all device tensors):
        q_nope ``[num_tokens, H, 512]``, q_pe ``[num_tokens, H, 64]`` (``dtype``);
        kv_cache ``[num_pages, page_size, 576]`` (``kv_dtype``); k_scale fp32 ``[1]``;
        page_table int32 ``[num_entries]``; page_table_start, kv_lens int32 ``[batch]``;
        qo_indptr int32 ``[batch + 1]``; cu_blocks int32 ``[batch + 1]``;
        part_begin_req, part_end_req int32 ``[num_parts]``; blocks_per_part int32 ``[1]``;
        out ``[num_tokens, H, 512]`` (``dtype``); lse fp32 ``[num_tokens, H]`` (natural log);
        out_partial fp32 ``[num_slots, H * q_len, 512]``; lse_partial fp32 ``[num_slots, H * q_len]`` (log2);
        merge_count int32 ``[num_counts]`` (the kernels that merge splits themselves count parts there; not read here).
    """
    block_rows, block_n = cfg.block_rows, cfg.block_n
    rows = num_heads * q_len
    n_row_blocks = num_row_blocks(num_heads, q_len, block_rows)
    accum = "float32"
    is_fp8 = kv_dtype != dtype

    num_tokens = T.dynamic("num_tokens")
    batch = T.dynamic("batch")
    num_pages = T.dynamic("num_pages")
    num_entries = T.dynamic("num_entries")
    num_parts = T.dynamic("num_parts")
    num_slots = T.dynamic("num_slots")
    num_counts = T.dynamic("num_counts")
    # q halves are read in place from whatever views the engine hands over (vLLM's q_nope is a
    # transposed bmm output, a 576-wide q gives two strided slices): strides are runtime values.
    q_nope_stride = (T.dynamic("q_nope_stride_t"), T.dynamic("q_nope_stride_h"), 1)
    q_pe_stride = (T.dynamic("q_pe_stride_t"), T.dynamic("q_pe_stride_h"), 1)
    store_rows = make_store_rows(num_heads, q_len, block_rows, KV_LORA_RANK).store

    @T.macro
    def load_block(kv_cache, page_table, pt0, pos0, kv_len, kv_dst, pe_dst):
        """Gathers KV rows pos0 .. pos0 + block_n of one request into shared memory.

        Rows past kv_len re-read row kv_len - 1 (their probabilities are 0): no page outside the
        request is touched and no stale (possibly NaN) cache slot can reach P @ V.
        """
        for j, d in T.Parallel(block_n, KV_LORA_RANK):
            kv_dst[j, d] = kv_cache[page_table[pt0 + T.min(pos0 + j, kv_len - 1) // page_size],
                                    T.min(pos0 + j, kv_len - 1) % page_size, d]
        for j, d in T.Parallel(block_n, ROPE_DIM):
            pe_dst[j, d] = kv_cache[page_table[pt0 + T.min(pos0 + j, kv_len - 1) // page_size],
                                    T.min(pos0 + j, kv_len - 1) % page_size, KV_LORA_RANK + d]

    @T.macro
    def dequant(kv_src, pe_src, kv_dst, pe_dst):
        """e4m3 -> fp16/bf16 is exact; the per-tensor scale is applied to S and O instead (also exact)."""
        for j, d in T.Parallel(block_n, KV_LORA_RANK):
            kv_dst[j, d] = T.cast(kv_src[j, d], dtype)
        for j, d in T.Parallel(block_n, ROPE_DIM):
            pe_dst[j, d] = T.cast(pe_src[j, d], dtype)

    @T.macro
    def attend_block(q_shared, q_pe_shared, kv_shared, k_pe_shared, p_shared, acc_s, acc_o, m_prev, m_cur, alpha,
                     row_sum, l_sum, pos0, vis0, row0, scale_log2):
        """Online-softmax update of acc_o with one KV block (log2 domain, causal/length masked)."""
        T.clear(acc_s)
        T.gemm(q_shared, kv_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        T.gemm(q_pe_shared, k_pe_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for i, j in T.Parallel(block_rows, block_n):
            acc_s[i, j] = T.if_then_else(pos0 + j < vis0 + (row0 + i) // num_heads, acc_s[i, j] * scale_log2,
                                         -T.infinity(accum))
        T.copy(m_cur, m_prev)
        T.reduce_max(acc_s, m_cur, dim=1, clear=False)
        # A row that has seen nothing yet keeps max -inf: offset by 0 instead, so exp2 gives 0, not NaN.
        for i in T.Parallel(block_rows):
            alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1, T.exp2(m_prev[i] - m_cur[i]))
        for i, j in T.Parallel(block_rows, block_n):
            acc_s[i, j] = T.exp2(acc_s[i, j] - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
        T.reduce_sum(acc_s, row_sum, dim=1)
        T.copy(acc_s, p_shared)
        for i in T.Parallel(block_rows):
            l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
        for i, d in T.Parallel(block_rows, KV_LORA_RANK):
            acc_o[i, d] *= alpha[i]
        T.gemm(p_shared, kv_shared, acc_o, policy=T.GemmWarpPolicy.FullCol)

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
        blocks_per_part: T.Tensor([1], "int32"),
        sm_scale: T.Tensor([1], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
        merge_count: T.Tensor([num_counts], "int32"),
    ):
        with T.Kernel(num_parts, n_row_blocks, threads=cfg.threads) as (part, row_block):
            q_shared = T.alloc_shared([block_rows, KV_LORA_RANK], dtype)
            q_pe_shared = T.alloc_shared([block_rows, ROPE_DIM], dtype)
            kv_shared = T.alloc_shared([block_n, KV_LORA_RANK], dtype)
            k_pe_shared = T.alloc_shared([block_n, ROPE_DIM], dtype)
            p_shared = T.alloc_shared([block_rows, block_n], dtype)
            acc_s = T.alloc_fragment([block_rows, block_n], accum)
            acc_o = T.alloc_fragment([block_rows, KV_LORA_RANK], accum)
            m_prev = T.alloc_fragment([block_rows], accum)
            m_cur = T.alloc_fragment([block_rows], accum)
            alpha = T.alloc_fragment([block_rows], accum)
            row_sum = T.alloc_fragment([block_rows], accum)
            l_sum = T.alloc_fragment([block_rows], accum)
            if is_fp8:  # fp8 tiles land here, then are dequantised into kv_shared / k_pe_shared
                kv_stage = T.alloc_shared([block_n, KV_LORA_RANK], kv_dtype)
                pe_stage = T.alloc_shared([block_n, ROPE_DIM], kv_dtype)
            else:
                kv_stage, pe_stage = kv_shared, k_pe_shared

            wait_for_inputs(cfg.pdl)
            # S = q . (k_scale * k8) = k_scale * (q . k8) and O = k_scale * (P @ v8): fold the fp8 scale
            # into the softmax scale and the output (k_scale is 1 for fp16/bf16 caches).
            kv_scale = k_scale[0]
            scale_log2 = sm_scale[0] * kv_scale * LOG2E
            width = blocks_per_part[0]
            part_lo = part * width
            part_hi = T.min(part_lo + width, cu_blocks[batch])
            row0 = row_block * block_rows

            for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                req_lo = cu_blocks[req]
                req_hi = cu_blocks[req + 1]
                blk_lo = T.max(part_lo, req_lo) - req_lo
                blk_hi = T.min(part_hi, req_hi) - req_lo
                if blk_hi > blk_lo:
                    kv_len = kv_lens[req]
                    tok0 = qo_indptr[req]
                    pt0 = page_table_start[req]
                    # positions visible to row r: < kv_len - q_len + r // H + 1
                    vis0 = kv_len - q_len + 1
                    for i, d in T.Parallel(block_rows, KV_LORA_RANK):
                        q_shared[i, d] = T.if_then_else(
                            row0 + i < rows,
                            q_nope[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, d], 0)
                    for i, d in T.Parallel(block_rows, ROPE_DIM):
                        q_pe_shared[i, d] = T.if_then_else(
                            row0 + i < rows,
                            q_pe[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, d], 0)
                    T.fill(acc_o, 0)
                    T.fill(l_sum, 0)
                    T.fill(m_cur, -T.infinity(accum))

                    for blk in pipelined(blk_hi - blk_lo, 1 if is_fp8 else cfg.num_stages):
                        pos0 = (blk_lo + blk) * block_n
                        load_block(kv_cache, page_table, pt0, pos0, kv_len, kv_stage, pe_stage)
                        if is_fp8:
                            dequant(kv_stage, pe_stage, kv_shared, k_pe_shared)
                        attend_block(q_shared, q_pe_shared, kv_shared, k_pe_shared, p_shared, acc_s, acc_o, m_prev, m_cur,
                                     alpha, row_sum, l_sum, pos0, vis0, row0, scale_log2)

                    # direct write when the whole request lies in this part, else partial slot part + req
                    store_rows(acc_o, l_sum, m_cur, kv_scale, req_lo // width == (req_hi - 1) // width, part + req,
                               tok0, row0, out, lse, out_partial, lse_partial)

    return mla_decode_split


# Partial rows the combine loads back to back (independent loads in flight per thread): rounds of
# COMBINE_UNROLL, then of COMBINE_TAIL for the rest.
COMBINE_UNROLL = 8
COMBINE_TAIL = 4
# Up to this many parts per request the combine reduces the partial LSEs serially in every thread (no block
# barrier): 2-part requests dominate large batches, where a block-wide reduction measured slower.
COMBINE_SERIAL_LSE = 8
# The wide combine (short batches, many parts per request): a program per (request, row, 128 dims), its 4 warps
# each summing every 4th part; each thread loads its first COMBINE_WIDE_LOADS partial rows (4 floats each) before
# the merge weights are known, so those loads overlap the LSE reduction instead of following it.
COMBINE_WIDE_DIMS = 128
COMBINE_WIDE_GROUPS = 4
COMBINE_WIDE_LOADS = 16
# mla_decode picks the wide combine where the per-row grid is small (batch x rows programs) and requests have many
# parts. H100, graph replay: b=1 h=16 (16 programs, 64 parts each) 4.5 -> 3.7 us; b=4 h=16 (64 programs, 33 parts)
# 3.6 -> 3.8 and b=1 h=128 (128 programs) 5.6 -> 5.8, so not there.
COMBINE_WIDE_MAX_PROGRAMS = 32
COMBINE_WIDE_MIN_PARTS = 8


def use_wide_combine(batch: int, rows: int, num_parts: int) -> bool:
    """Whether ``mla_decode`` merges with the wide combine: ``rows`` = heads x q_len, ``num_parts`` the plan's."""
    return batch * rows <= COMBINE_WIDE_MAX_PROGRAMS and num_parts >= COMBINE_WIDE_MIN_PARTS * batch


# The tiled combine: a program per (request, COMBINE_TILE_ROWS rows) merges them side by side. A large batch's combine
# often has nothing to do (requests unsplit, or of two parts the split kernel merged) but still launches its programs:
# at b=64 x 128 rows, 8192 per-row programs take 6.6 us on the H100 for nothing, 512 tiled ones 2.3 (end to end
# b=64 s_k=4096 h=64 s_q=2: 153.7 -> 149.4 us), and with work (ragged lengths) the tiled one is faster from 64 rows
# (b=64 h=128: 9.3 -> 7.1 us; b=128 h=128 s_q=2, where the split kernel merges most: 21.3 -> 4.1). Below 64 rows a
# request's one or two whole-width programs were slower where there is work (h=16 b=64 ragged 4.5 -> 6.3 us; session
# 26, call 1), so there each program takes a quarter of the 512 columns: idle 1.8-2.3 us instead of 2.4-4.1, with work
# 4.3-4.9 instead of 5.1-6.0 from 2048 rows in all, but still 0.7-1.6 us slower at 1024 (b=64 h=16, b=32 h=32; call 6).
COMBINE_TILE_ROWS = 16
COMBINE_TILE_LANES = 8  # threads per row reducing its partial LSEs (shuffles within 8 lanes)
COMBINE_TILE_UNROLL = 4  # parts whose partial tiles are loaded back to back
COMBINE_TILED_MIN_PROGRAMS = 2048  # per-row programs (batch x rows) from which the tiled combine takes over
COMBINE_TILE_NARROW_ROWS = 64  # below this many rows, COMBINE_TILE_NARROW_CHUNKS programs per tile
COMBINE_TILE_NARROW_CHUNKS = 4


def tiled_combine_chunks(rows: int) -> int:
    """Column chunks (programs per 16-row tile) of the tiled combine for ``rows`` = heads x q_len."""
    return COMBINE_TILE_NARROW_CHUNKS if rows < COMBINE_TILE_NARROW_ROWS else 1


def use_tiled_combine(batch: int, rows: int) -> bool:
    """Whether ``mla_decode`` merges with the tiled combine (where the variant has one): ``rows`` = heads x q_len."""
    return batch * rows >= COMBINE_TILED_MIN_PROGRAMS


def build_tiled_combine_kernel(num_heads: int, q_len: int, dtype: str, merged: int = 0, chunks: int = 1,
                               pdl: bool = False):
    """The combine of :func:`build_combine_kernel` (same arguments and results) with one program per (request,
    ``COMBINE_TILE_ROWS`` rows, 512 / ``chunks`` columns): each row's ``COMBINE_TILE_LANES`` threads turn its partial
    LSEs into normalised weights in shared memory (up to ``MAX_PARTS`` parts), then the 128 threads sum the partial
    tiles ``[COMBINE_TILE_ROWS, 512 / chunks]`` of ``COMBINE_TILE_UNROLL`` parts at a time. The chunks' programs each
    reduce the LSEs (chunk 0 writes ``lse``). Up to ``COMBINE_SERIAL_LSE`` parts the result has the per-row combine's
    bits (the same sums in the same order)."""
    rows = num_heads * q_len
    accum = "float32"
    tile_rows, lanes = COMBINE_TILE_ROWS, COMBINE_TILE_LANES
    threads = tile_rows * lanes
    cols = KV_LORA_RANK // chunks

    num_tokens = T.dynamic("num_tokens")
    batch = T.dynamic("batch")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def mla_decode_combine_tiled(
        qo_indptr: T.Tensor([batch + 1], "int32"),
        cu_blocks: T.Tensor([batch + 1], "int32"),
        blocks_per_part: T.Tensor([1], "int32"),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
    ):
        with T.Kernel(batch, T.ceildiv(rows, tile_rows), chunks, threads=threads) as (req, tile, chunk):
            weight_s = T.alloc_shared([tile_rows, MAX_PARTS], accum)  # per row, its parts' merge weights
            acc = T.alloc_fragment([tile_rows, cols], accum)
            part_tile = T.alloc_fragment([tile_rows, cols], accum)  # one part's partial rows, loaded as float4s
            top = T.alloc_var(accum)  # this row's largest partial LSE (log2), then the offset
            total = T.alloc_var(accum)  # sum of exp2(LSE - offset) over the row's parts
            first = T.alloc_var("int32")  # the request's first part (its partial slots are first + i + req)
            n_read = T.alloc_var("int32")  # its number of parts
            wait_for_inputs(pdl)
            tx = T.get_thread_binding()
            r = tx // lanes
            lane = tx % lanes
            row0 = tile * tile_rows
            row = T.min(row0 + r, rows - 1)  # this thread's row for the LSE loads (clamped: a last partial tile)
            tok0 = qo_indptr[req]
            width = blocks_per_part[0]
            req_lo = cu_blocks[req]
            req_hi = cu_blocks[req + 1]
            first_part, parts = request_parts(req_lo, req_hi, width)
            first = first_part
            n_read = T.min(parts, MAX_PARTS)
            if req_hi == req_lo:
                for i, d in T.Parallel(tile_rows, cols):
                    if row0 + i < rows:
                        out[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, chunk * cols + d] = T.cast(0, dtype)
                if lane == 0 and row0 + r < rows and chunk == 0:
                    lse[tok0 + (row0 + r) // num_heads, (row0 + r) % num_heads] = -T.infinity(accum)
            elif n_read > max(1, merged):
                # lane l walks parts l, l + 8, ...: the row's max (exact in any order), then exp2(LSE - max) into
                # weight_s; every lane sums the row's weights in part order, as the per-row combine does up to
                # COMBINE_SERIAL_LSE parts, so that the two give the same bits there (which one runs depends on the
                # batch size, and vLLM's full CUDA graphs pad the batch)
                top = -T.infinity(accum)
                for k in T.serial(T.ceildiv(T.max(n_read - lane, 0), lanes)):
                    top = T.max(top, lse_partial[first + lane + k * lanes + req, row])
                for delta in T.unroll(3):
                    top = T.max(top, T.shfl_xor(top, 4 >> delta))
                top = T.if_then_else(top == -T.infinity(accum), 0, top)  # every part saw nothing: weights 0, no NaN
                for k in T.serial(T.ceildiv(T.max(n_read - lane, 0), lanes)):
                    weight_s[r, lane + k * lanes] = T.exp2(lse_partial[first + lane + k * lanes + req, row] - top)
                T.sync_threads()
                total = 0
                for j in T.serial(n_read):
                    total += weight_s[r, j]
                T.sync_threads()
                for k in T.serial(T.ceildiv(T.max(n_read - lane, 0), lanes)):
                    weight_s[r, lane + k * lanes] = T.if_then_else(total > 0, weight_s[r, lane + k * lanes] / total, 0)
                if lane == 0 and row0 + r < rows and chunk == 0:
                    lse[tok0 + (row0 + r) // num_heads, (row0 + r) % num_heads] = T.if_then_else(
                        total > 0, (T.log2(total) + top) * LN2, -T.infinity(accum))
                T.sync_threads()
                T.clear(acc)
                # past the last part: the last part's tile again, weighted 0 (no branch between the loads)
                for j0 in T.serial(T.ceildiv(n_read, COMBINE_TILE_UNROLL)):
                    for u in T.unroll(COMBINE_TILE_UNROLL):
                        j = j0 * COMBINE_TILE_UNROLL + u
                        jc = T.min(j, n_read - 1)
                        for i, d in T.Parallel(tile_rows, cols):
                            part_tile[i, d] = out_partial[first + jc + req, T.min(row0 + i, rows - 1), chunk * cols + d]
                        # one rounding per term, as in the per-row combine (whose multiply-add nvcc contracts; here
                        # the loads' bounds branches split them, so the fma is explicit)
                        for i, d in T.Parallel(tile_rows, cols):
                            acc[i, d] = T.ieee_fmaf(T.if_then_else(j < n_read, weight_s[i, jc], 0), part_tile[i, d],
                                                    acc[i, d])
                for i, d in T.Parallel(tile_rows, cols):
                    if row0 + i < rows:
                        out[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, chunk * cols + d] = T.cast(
                            acc[i, d], dtype)

    return mla_decode_combine_tiled


def build_combine_kernel(num_heads: int, q_len: int, dtype: str, wide: bool = False, merged: int = 0,
                         pdl: bool = False):
    """Merges the partial outputs of split requests; writes zeros / -inf for empty requests.

    One program per (request, row), or with ``wide`` per (request, row, 128-dim chunk); requests whose single
    part wrote the output directly return, and so do those of up to ``merged`` parts, which the split kernel
    merged itself (``configs.merged_parts``). The request's partial LSEs become merge weights in shared memory:
    more than ``COMBINE_SERIAL_LSE`` parts (up to ``MAX_PARTS``, two per thread) are reduced across the block
    (max, then the sum of exp2), fewer are walked serially by every thread (no block barrier). The 512-wide rows
    are summed ``COMBINE_UNROLL`` at a time, then ``COMBINE_TAIL`` at a time from clamped indices (no branch
    between the loads), so a small batch with many splits waits on a few load latencies, not one per split.
    ``wide`` (see ``COMBINE_WIDE_LOADS``) waits on one round for up to 64 parts, at four times the programs.
    """
    rows = num_heads * q_len
    accum = "float32"
    threads = 128
    n_chunks = KV_LORA_RANK // COMBINE_WIDE_DIMS if wide else 1
    lanes = threads // COMBINE_WIDE_GROUPS  # wide: a warp covers the chunk's 128 dims, 4 per lane

    num_tokens = T.dynamic("num_tokens")
    batch = T.dynamic("batch")
    num_slots = T.dynamic("num_slots")

    @T.prim_func
    def mla_decode_combine(
        qo_indptr: T.Tensor([batch + 1], "int32"),
        cu_blocks: T.Tensor([batch + 1], "int32"),
        blocks_per_part: T.Tensor([1], "int32"),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
    ):
        with T.Kernel(batch, rows, n_chunks, threads=threads) as (req, row, chunk):
            lse_f = T.alloc_fragment([MAX_PARTS], accum)  # partial LSEs, then their exp2 weights
            weight_s = T.alloc_shared([MAX_PARTS], accum)
            lse_s = T.alloc_shared([COMBINE_SERIAL_LSE], accum)
            lse_max = T.alloc_fragment([1], accum)
            lse_sum = T.alloc_fragment([1], accum)
            lse_top = T.alloc_var(accum)  # the same two, reduced serially by every thread (few parts)
            lse_acc = T.alloc_var(accum)
            first = T.alloc_var("int32")  # the request's first part (its partial slots are first + i + req)
            n_read = T.alloc_var("int32")  # its number of parts (the planner makes at most MAX_PARTS)
            if wide:
                raw = T.alloc_local([COMBINE_WIDE_LOADS, 4], accum)  # this thread's first partial rows
                acc_w = T.alloc_local([4], accum)
                sums = T.alloc_shared([COMBINE_WIDE_GROUPS, COMBINE_WIDE_DIMS], accum)  # per warp, then added
            else:
                acc = T.alloc_fragment([KV_LORA_RANK], accum)
            wait_for_inputs(pdl)
            width = blocks_per_part[0]
            req_lo = cu_blocks[req]
            req_hi = cu_blocks[req + 1]
            first_part, parts = request_parts(req_lo, req_hi, width)
            first = first_part
            n_read = T.min(parts, MAX_PARTS)
            tok = qo_indptr[req] + row // num_heads
            head = row % num_heads
            d0 = chunk * COMBINE_WIDE_DIMS if wide else 0
            if req_hi == req_lo:
                for d in T.Parallel(KV_LORA_RANK // n_chunks):
                    out[tok, head, d0 + d] = T.cast(0, dtype)
                if chunk == 0:
                    lse[tok, head] = -T.infinity(accum)
            elif n_read > max(1, merged):
                if wide:
                    tx = T.get_thread_binding()
                    grp = tx // lanes
                    col = d0 + (tx % lanes) * 4
                    # warp grp sums parts grp, grp + 4, ...; the first COMBINE_WIDE_LOADS of them are loaded now
                    # (past the last part: the last part again, weighted 0 below)
                    for u in T.unroll(COMBINE_WIDE_LOADS):
                        for k in T.vectorized(4):
                            raw[u, k] = out_partial[first + T.min(grp + u * COMBINE_WIDE_GROUPS, n_read - 1) + req,
                                                    row, col + k]
                # merge weights: weight_s[i] = part i's share; lse_max / lse_sum: the log2 LSE's offset and sum
                if n_read > COMBINE_SERIAL_LSE:
                    # many parts (small batches): LSE max and sum reduced across the block, two per thread
                    for i in T.Parallel(MAX_PARTS):
                        lse_f[i] = T.if_then_else(i < n_read, lse_partial[first + i + req, row], -T.infinity(accum))
                    T.reduce_max(lse_f, lse_max, dim=0, clear=True)
                    # all partials -inf (row saw nothing): offset 0 keeps exp2 at 0 instead of NaN
                    lse_max[0] = T.if_then_else(lse_max[0] == -T.infinity(accum), 0, lse_max[0])
                    for i in T.Parallel(MAX_PARTS):
                        lse_f[i] = T.exp2(lse_f[i] - lse_max[0])
                    T.reduce_sum(lse_f, lse_sum, dim=0)
                    for i in T.Parallel(MAX_PARTS):
                        weight_s[i] = T.if_then_else(lse_sum[0] > 0, lse_f[i] / lse_sum[0], 0)
                else:
                    # a few parts (most requests of a large batch): every thread walks them, no block barrier
                    for i in T.Parallel(COMBINE_SERIAL_LSE):
                        lse_s[i] = T.if_then_else(i < n_read, lse_partial[first + i + req, row], -T.infinity(accum))
                    lse_top = -T.infinity(accum)
                    for i in T.serial(n_read):
                        lse_top = T.max(lse_top, lse_s[i])
                    lse_top = T.if_then_else(lse_top == -T.infinity(accum), 0, lse_top)
                    lse_acc = 0
                    for i in T.serial(n_read):
                        lse_acc += T.exp2(lse_s[i] - lse_top)
                    for i in T.Parallel(COMBINE_SERIAL_LSE):
                        weight_s[i] = T.if_then_else(lse_acc > 0, T.exp2(lse_s[i] - lse_top) / lse_acc, 0)
                    lse_max[0] = lse_top
                    lse_sum[0] = lse_acc
                if wide:
                    for k in T.vectorized(4):
                        acc_w[k] = 0
                    for u in T.unroll(COMBINE_WIDE_LOADS):
                        j = grp + u * COMBINE_WIDE_GROUPS
                        for k in T.vectorized(4):
                            acc_w[k] += T.if_then_else(j < n_read, weight_s[T.min(j, n_read - 1)], 0) * raw[u, k]
                    # parts past the first 4 x COMBINE_WIDE_LOADS (more than 64 parts): COMBINE_TAIL per round
                    n_rest = n_read - COMBINE_WIDE_GROUPS * COMBINE_WIDE_LOADS
                    for i0 in T.serial(T.ceildiv(T.max(n_rest, 0), COMBINE_WIDE_GROUPS * COMBINE_TAIL)):
                        for u in T.unroll(COMBINE_TAIL):
                            j = COMBINE_WIDE_GROUPS * (COMBINE_WIDE_LOADS + i0 * COMBINE_TAIL + u) + grp
                            i = T.min(j, n_read - 1)
                            w = T.if_then_else(j < n_read, weight_s[i], 0)
                            for k in T.vectorized(4):
                                acc_w[k] += w * out_partial[first + i + req, row, col + k]
                    for k in T.vectorized(4):
                        sums[grp, (tx % lanes) * 4 + k] = acc_w[k]
                    for d in T.Parallel(COMBINE_WIDE_DIMS):
                        out[tok, head, d0 + d] = T.cast(sums[0, d] + sums[1, d] + sums[2, d] + sums[3, d], dtype)
                else:
                    T.clear(acc)
                    n_full = n_read // COMBINE_UNROLL
                    for i0 in T.serial(n_full):
                        for u in T.unroll(COMBINE_UNROLL):
                            for d in T.Parallel(KV_LORA_RANK):
                                acc[d] += weight_s[i0 * COMBINE_UNROLL + u] * out_partial[
                                    first + i0 * COMBINE_UNROLL + u + req, row, d]
                    # the rest (most requests: 2 parts) COMBINE_TAIL at a time; past the last part, the last row
                    # is re-read with weight 0
                    for i0 in T.serial(T.ceildiv(n_read - n_full * COMBINE_UNROLL, COMBINE_TAIL)):
                        for u in T.unroll(COMBINE_TAIL):
                            j = n_full * COMBINE_UNROLL + i0 * COMBINE_TAIL + u
                            i = T.min(j, n_read - 1)
                            w = T.if_then_else(j < n_read, weight_s[i], 0)
                            for d in T.Parallel(KV_LORA_RANK):
                                acc[d] += w * out_partial[first + i + req, row, d]
                    for d in T.Parallel(KV_LORA_RANK):
                        out[tok, head, d] = T.cast(acc[d], dtype)
                # lse_max is the offset (0 where every partial was -inf, and then lse_sum is 0)
                if chunk == 0:
                    lse[tok, head] = T.if_then_else(lse_sum[0] > 0, (T.log2(lse_sum[0]) + lse_max[0]) * LN2,
                                                    -T.infinity(accum))

    return mla_decode_combine
