"""The combine kernels: merge the split kernel's fp32 partials of a request by their LSEs into ``out`` / ``lse``.

Three variants of one contract: one program per (request, row); the wide one per (request, row, 128 dims) for short
batches with many parts per request; the tiled one per (request, 16 rows) for large batches (sm90).
"""

from typing import Any, NamedTuple

import tilelang.language as T

from ..constants import KV_LORA_RANK, MAX_PARTS
from .common import LN2, request_parts, wait_for_inputs


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
# often has little to do (most requests unsplit) but still launches its programs: at b=64 x 128 rows, 8192 per-row
# programs take 6.6 us on the H100 for nothing, 512 tiled ones 2.3 (end to end b=64 s_k=4096 h=64 s_q=2: 153.7 ->
# 149.4 us), and with work (ragged lengths) the tiled one is faster from 64 rows (b=64 h=128: 9.3 -> 7.1 us). Below
# 64 rows a request's one or two whole-width programs were slower where there is work (h=16 b=64 ragged 4.5 -> 6.3
# us), so there each program takes a quarter of the 512 columns: idle 1.8-2.3 us instead of 2.4-4.1, with work
# 4.3-4.9 instead of 5.1-6.0 from 2048 rows in all, but still 0.7-1.6 us slower at 1024 (b=64 h=16, b=32 h=32).
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


class CombineDims(NamedTuple):
    """A combine kernel's symbolic sizes (runtime values, as the split kernel's)."""

    num_tokens: Any  # query tokens of the batch
    batch: Any  # requests (one program column each)
    num_slots: Any  # the split kernel's partial slots
    num_req_entries: Any  # entries of the plan's per-request part table


def combine_dims() -> CombineDims:
    """Fresh symbolic sizes for one combine kernel, each named as its field."""
    return CombineDims(*(T.dynamic(name) for name in CombineDims._fields))


def combine_prim_func(name: str, num_heads: int, q_len: int, dtype: str, dims: CombineDims, program):
    """The prim_func ``name`` of a combine variant, whose body is the macro ``program`` called with every argument (in
    this order), so the variants are interchangeable after the split kernel.

    Arguments (all device tensors; ``H`` = ``num_heads``, the other sizes ``dims``'): qo_indptr, cu_blocks int32
    ``[batch + 1]``, req_parts int32 ``[num_req_entries]`` (the split kernel's plan: request r's first part and
    number of parts at ``2 r`` and ``2 r + 1``); out_partial fp32
    ``[num_slots, H * q_len, 512]``, lse_partial fp32 ``[num_slots, H * q_len]`` (log2) (its partials); out
    ``[num_tokens, H, 512]`` (``dtype``), lse fp32 ``[num_tokens, H]`` (natural log).
    """
    num_tokens, batch, num_slots, num_req_entries = dims
    rows = num_heads * q_len
    accum = "float32"

    def combine(
        qo_indptr: T.Tensor([batch + 1], "int32"),
        cu_blocks: T.Tensor([batch + 1], "int32"),
        req_parts: T.Tensor([num_req_entries], "int32"),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
    ):
        program(qo_indptr, cu_blocks, req_parts, out_partial, lse_partial, out, lse)

    combine.__name__ = name  # the kernel's symbol
    return T.prim_func(combine)


@T.macro
def count_request_parts(req_parts, req, first: T.Ref, n_read: T.Ref):
    """The parts of request ``req`` in the planner's cut (its table ``req_parts``): the first into
    ``first`` (its partial slots are ``first + i + req``), how many into ``n_read`` (at most ``MAX_PARTS``, the most
    the planner makes and the combine's shared memory holds)."""
    first_part, parts = request_parts(req_parts, req)
    first = first_part
    n_read = T.min(parts, MAX_PARTS)


def build_tiled_combine_kernel(num_heads: int, q_len: int, dtype: str, chunks: int = 1, pdl: bool = False):
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

    dims = combine_dims()
    batch = dims.batch

    @T.macro
    def tiled_program(qo_indptr, cu_blocks, req_parts, out_partial, lse_partial, out, lse):
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
            req_lo = cu_blocks[req]
            req_hi = cu_blocks[req + 1]
            count_request_parts(req_parts, req, first, n_read)
            if req_hi == req_lo:
                for i, d in T.Parallel(tile_rows, cols):
                    if row0 + i < rows:
                        out[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, chunk * cols + d] = T.cast(0, dtype)
                if lane == 0 and row0 + r < rows and chunk == 0:
                    lse[tok0 + (row0 + r) // num_heads, (row0 + r) % num_heads] = -T.infinity(accum)
            elif n_read > 1:
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
                    weight_s[r, lane + k * lanes] = T.if_then_else(total == 0, 0, weight_s[r, lane + k * lanes] / total)
                if lane == 0 and row0 + r < rows and chunk == 0:
                    lse[tok0 + (row0 + r) // num_heads, (row0 + r) % num_heads] = T.if_then_else(
                        total == 0, -T.infinity(accum), (T.log2(total) + top) * LN2)
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

    return combine_prim_func("mla_decode_combine_tiled", num_heads, q_len, dtype, dims, tiled_program)


def build_combine_kernel(num_heads: int, q_len: int, dtype: str, wide: bool = False, pdl: bool = False):
    """Merges the partial outputs of split requests; writes zeros / -inf for empty requests.

    One program per (request, row), or with ``wide`` per (request, row, 128-dim chunk); requests whose single
    part wrote the output directly return. The request's partial LSEs become merge weights in shared memory:
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

    dims = combine_dims()
    batch = dims.batch

    @T.macro
    def row_program(qo_indptr, cu_blocks, req_parts, out_partial, lse_partial, out, lse):
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
            req_lo = cu_blocks[req]
            req_hi = cu_blocks[req + 1]
            count_request_parts(req_parts, req, first, n_read)
            tok = qo_indptr[req] + row // num_heads
            head = row % num_heads
            d0 = chunk * COMBINE_WIDE_DIMS if wide else 0
            if req_hi == req_lo:
                for d in T.Parallel(KV_LORA_RANK // n_chunks):
                    out[tok, head, d0 + d] = T.cast(0, dtype)
                if chunk == 0:
                    lse[tok, head] = -T.infinity(accum)
            elif n_read > 1:
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
                        weight_s[i] = T.if_then_else(lse_sum[0] == 0, 0, lse_f[i] / lse_sum[0])
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
                        weight_s[i] = T.if_then_else(lse_acc == 0, 0, T.exp2(lse_s[i] - lse_top) / lse_acc)
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
                    lse[tok, head] = T.if_then_else(lse_sum[0] == 0, -T.infinity(accum),
                                                    (T.log2(lse_sum[0]) + lse_max[0]) * LN2)

    return combine_prim_func("mla_decode_combine", num_heads, q_len, dtype, dims, row_program)
