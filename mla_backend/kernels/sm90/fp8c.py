"""fp8 compute in the ws kernel (``KernelConfig.fp8_compute``, an fp8 cache, h x q_len > 16): S and P V on e4m3
WGMMA, the cache never converted.

* Producer (one warpgroup, 96 registers): per request segment it quantises Q to e4m3 with one scale per (token,
  head) row (amax / 448; 8 threads per row) into the Q8 tiles and ``qscale``; per block it gathers the raw e4m3 rows
  into one of two K8 buffers: TMA where the whole block lies in one page, else cp.async through the page table, both
  completing ``k_ready``.
* WG0 (240 registers): ``S = Q8 K8^T`` (m64n64k32 e4m3, 18 k-steps), scaled per row by qscale x k_scale x the
  softmax scale; the online softmax as in the 16-bit kernel; ``P x 256`` in e4m3 into shared memory (P8), each
  16-token group's columns in the ldmatrix token order; then its half of P V.
* P V as ``O^T = V^T P^T`` (both consumers, 256 dims each): e4m3 WGMMA reads B only K-major, and V^T is the A
  operand, which may come from registers: ``ldmatrix.trans`` of the consumer's K8 tile (two byte permutes per
  register) builds V^T's fragments, P8 [rows, tokens] is the K-major B. No V^T is ever stored. The accumulator is
  O^T (a thread holds two adjacent dims of 16 query rows), so alpha and 1 / l scale its columns (from the shared
  alpha slots and l), and the epilogue writes O^T to the output's rows.
* WG1 (168 registers: 128 accumulators plus an RS WGMMA's A registers in flight): ``O[:, 256:]`` from P8 and its
  K8 tile. The epilogue undoes P's 256 and applies k_scale.

Barriers beyond the 16-bit ws kernel's (arrive counts in threads; protocol.py's parities):

    barrier        count  arrived by                           waited by (parity)
    k_ready[b]      128   producer (TMA bytes + arrive, or     WG0 before S(g), WG1 before its P V(g), the producer
                          cp.async noinc)                      for its own copies (none in flight at exit):
                                                               kv_ready_parity(g)
    k_free[b]       256   WG0 and WG1, each after its P V(g)   producer before filling block g + 2: kv_free_parity
                          (K8 is read by S and by both P Vs)
    q_ready         128   producer (plain arrive, after a      WG0 at a segment's start: seg_ready_parity(s)
                          proxy fence)

p_ready / p_free, q_free and l_ready / l_free are the 16-bit kernel's (p_free: WG1 is done with P8, its B operand).
WG0 reads its own alpha slot back (inside its P V) after its named barrier, and its columns of l after the one that
follows ``send_l``; WG1 reads them between p_ready and p_free, l_ready and l_free.

Shared memory (bytes): Q8 64 x 576 = 36864, qscale 256, K8 x 2 = 73728, P8 64 x 64 = 4096, alpha slots 512, l 256:
115712 dynamic.
"""

from functools import lru_cache
from importlib import resources
from types import SimpleNamespace

import tilelang.language as T

from ...constants import HEAD_DIM, KV_LORA_RANK, ROPE_DIM
from ..common import LOG2E, wait_for_inputs
from ..configs import kernel_launch
from .fp8c_roles import fp8c_roles
from .protocol import (HALF, SEG_TRACE_STEP, alpha_slot, kv_buffer, kv_free_parity, kv_ready_parity,
                       seg_free_parity)

Q8_THREADS_PER_ROW = 8  # producer threads per Q row (each 72 of its 576 values)


@lru_cache(maxsize=None)
def fp8c_prelude() -> str:
    """The fp8c kernel's device helpers (fp8c.cuh, package data), pasted after protocol.PRELUDE."""
    return resources.files(__package__).joinpath("fp8c.cuh").read_text()


def acc_o_layout(block_rows: int, wg: int):
    """The m64n256 WGMMA accumulator layout of warpgroup wg's O tile [block_rows, 256] (WG1's threads are 128 on):
    element (i, j) in thread 32 (i / 16) + 4 (i % 8) + (j % 8) / 2, register 4 (j / 8) + 2 ((i / 8) % 2) + j % 2.
    No TileLang GEMM writes O (P V is inline PTX); without this annotation TileLang infers a layout from the
    epilogue's loops that spills or puts WG1's fragment on threads 0..127. The helpers of fp8c.cuh read the 128
    registers as O^T's four m64n64 tiles."""
    return T.Fragment([block_rows, HALF],
                      forward_thread_fn=lambda i, j: wg * 128 + (i // 16) * 32 + (i % 8) * 4 + (j % 8) // 2,
                      forward_index_fn=lambda i, j: (j // 8) * 4 + ((i // 8) % 2) * 2 + j % 2)


def fp8c_macros(k):
    """The fp8c producer's segment and the consumers' GEMMs of variant ``k`` (kernel.variant_spec with ``fp8c``)."""
    block_n, num_heads, page_size, q_rows, rows = k.block_n, k.num_heads, k.page_size, k.q_rows, k.rows
    q8_helper = "<true>" if k.dtype == "bfloat16" else "<false>"
    q8_inv, q8_store = "mla_q8_inv_scale" + q8_helper, "mla_q8_store8" + q8_helper
    tma8 = page_size % block_n == 0  # a whole block lies in one page

    # ------------------------------------------------------------------ producer
    @T.macro
    def store_q8(qraw, chunk, inv, q8, i, col):
        """Chunk ``chunk`` of this thread's Q row (8 values) times ``inv`` -> e4m3 at ``q8[i, col ..]``; a plain
        address, so TileLang adds no barrier among the producer's warps."""
        T.evaluate(T.call_extern("handle", q8_store, T.access_ptr(qraw[chunk, 0], "r", 8), inv,
                                 T.address_of(q8[i, col])))

    @T.macro
    def quantise_q(q_nope, q_pe, q8_l, q8_r, q8_t, qscale, qraw, tok0, row0, t):
        """The segment's valid Q rows -> e4m3 in the Q8 tiles (times 448 / the row's amax) and each row's scale
        (amax / 448) in ``qscale``; 16 rows per pass, 8 threads per row, each with 9 chunks of 8 values (nope chunks
        u, u + 8, ..., rope chunk u). Rows past ``rows`` load row 0 (the row's shuffles need all 8 lanes) and store
        nothing."""
        for r in T.serial(q_rows // 16):
            i = r * 16 + t // Q8_THREADS_PER_ROW
            u = t % Q8_THREADS_PER_ROW
            valid = row0 + i < rows
            row = T.if_then_else(valid, row0 + i, 0)
            tok, head = tok0 + row // num_heads, row % num_heads
            for c in T.unroll(8):
                T.evaluate(T.call_extern("handle", "mla_ldg16", T.access_ptr(qraw[c, 0], "w", 8),
                                         T.access_ptr(q_nope[tok, head, (u + 8 * c) * 8], "r", 8)))
            T.evaluate(T.call_extern("handle", "mla_ldg16", T.access_ptr(qraw[8, 0], "w", 8),
                                     T.access_ptr(q_pe[tok, head, u * 8], "r", 8)))
            inv = T.call_extern("float32", q8_inv, T.access_ptr(qraw[0, 0], "r", 72), T.address_of(qscale[i]),
                                T.Cast("int32", valid))
            if valid:
                for c in T.unroll(4):  # chunks 0..3: dims < 256; 4..7: the right tile
                    store_q8(qraw, c, inv, q8_l, i, (u + 8 * c) * 8)
                    store_q8(qraw, c + 4, inv, q8_r, i, (u + 8 * c) * 8)
                store_q8(qraw, 8, inv, q8_t, i, u * 8)

    def k8_row(pos0, r, t, kv_len):
        """Position of producer thread t's row r (t // 4 + 32 r) of the block at pos0, tail clamped (rows past kv_len
        re-read the last row: their probabilities are 0, and no stale slot reaches P V)."""
        return T.min(pos0 + r * 32 + t // 4, kv_len - 1)

    @T.macro
    def gather_k8(kv_cache, page_table, pt0, pos0, kv_len, kv8_l, kv8_r, k8_t, t):
        """cp.async of the block at pos0's raw e4m3 rows into one K8 buffer: 4 threads per row, 9 16-byte chunks each
        (chunk c at dims c * 64 + (t % 4) * 16: 8 latent, then the rope)."""
        for r in T.unroll(2):
            p = k8_row(pos0, r, t, kv_len)
            page = page_table[pt0 + p // page_size]
            j = r * 32 + t // 4
            for c in T.unroll(9):
                col = c * 64 + (t % 4) * 16
                if c < 4:
                    T.ptx_cp_async(T.access_ptr(kv8_l[j, col], "w", 16),
                                   T.access_ptr(kv_cache[page, p % page_size, col], "r", 16), 16)
                elif c < 8:
                    T.ptx_cp_async(T.access_ptr(kv8_r[j, col - HALF], "w", 16),
                                   T.access_ptr(kv_cache[page, p % page_size, col], "r", 16), 16)
                else:
                    T.ptx_cp_async(T.access_ptr(k8_t[j, (t % 4) * 16], "w", 16),
                                   T.access_ptr(kv_cache[page, p % page_size, col], "r", 16), 16)

    @T.macro
    def fill_block(kv_cache, page_table, pt0, pos0, kv_len, g, kv8_l, kv8_r, k8_t, k_ready, k_free, t):
        """Block g's raw rows into its K8 buffer, once both consumers' P V of block g - 2 are done with it: a whole
        block in one page by TMA (its bytes complete k_ready with the producer's arrivals), else the cp.async
        gather."""
        T.barrier_wait(k_free[kv_buffer(g)], kv_free_parity(g))
        if tma8 and pos0 + block_n <= kv_len:
            page = page_table[pt0 + pos0 // page_size]
            slot0 = pos0 % page_size
            T.tma_copy(kv_cache[page, slot0:slot0 + block_n, 0:HALF], kv8_l, barrier=k_ready[kv_buffer(g)])
            T.tma_copy(kv_cache[page, slot0:slot0 + block_n, HALF:KV_LORA_RANK], kv8_r,
                       barrier=k_ready[kv_buffer(g)])
            T.tma_copy(kv_cache[page, slot0:slot0 + block_n, KV_LORA_RANK:HEAD_DIM], k8_t,
                       barrier=k_ready[kv_buffer(g)])
            T.barrier_arrive(k_ready[kv_buffer(g)])
        else:
            gather_k8(kv_cache, page_table, pt0, pos0, kv_len, kv8_l, kv8_r, k8_t, t)
            T.cp_async_barrier_noinc(k_ready[kv_buffer(g)])

    @T.macro
    def fill_block_any(kv_cache, page_table, pt0, pos0, kv_len, g, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t,
                       k_ready, k_free, t):
        if kv_buffer(g) == 0:
            fill_block(kv_cache, page_table, pt0, pos0, kv_len, g, kv80_l, kv80_r, k80_t, k_ready, k_free, t)
        else:
            fill_block(kv_cache, page_table, pt0, pos0, kv_len, g, kv81_l, kv81_r, k81_t, k_ready, k_free, t)

    @T.macro
    def produce_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg, q8_l,
                        q8_r, q8_t, qscale, qraw, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t, q_free, q_ready,
                        k_free, k_ready, t):
        """The producer, one request segment: the first block's copy, the segment's Q8 (once WG0 is done with the
        previous segment's), then per block the next block's copy and a wait for this block's own copies."""
        fill_block_any(kv_cache, page_table, pt0, blk_lo * block_n, kv_len, g0, kv80_l, kv80_r, k80_t, kv81_l,
                       kv81_r, k81_t, k_ready, k_free, t)
        k.trace(2, g0, SEG_TRACE_STEP - 2)  # segment stamps: the wait for Q8, then its quantisation
        T.barrier_wait(q_free[0], seg_free_parity(seg))
        k.trace(2, g0, SEG_TRACE_STEP - 1)
        quantise_q(q_nope, q_pe, q8_l, q8_r, q8_t, qscale, qraw, tok0, row0, t)
        T.fence_proxy_async()  # generic stores, read by WGMMA (async proxy)
        T.barrier_arrive(q_ready[0])
        k.trace(2, g0, SEG_TRACE_STEP)
        for blk in T.serial(blk_hi - blk_lo):
            g = g0 + blk
            k.trace(2, g, 0)
            if blk_lo + blk + 1 < blk_hi:
                fill_block_any(kv_cache, page_table, pt0, (blk_lo + blk + 1) * block_n, kv_len, g + 1, kv80_l,
                               kv80_r, k80_t, kv81_l, kv81_r, k81_t, k_ready, k_free, t)
            k.trace(2, g, 1)
            # its own copies of block g have landed, so none is in flight at the producer's exit
            T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
            k.trace(2, g, 2)

    # ------------------------------------------------------------------ consumers
    @T.macro
    def score8(q8_l, q8_r, q8_t, kv8_l, kv8_r, k8_t, acc_s):
        """S = Q8 K8^T over the 576 dims (e4m3, fp32 accumulators)."""
        T.clear(acc_s)
        T.wgmma_gemm(q8_l, kv8_l, acc_s, transpose_B=True)
        T.wgmma_gemm(q8_r, kv8_r, acc_s, transpose_B=True)
        T.wgmma_gemm(q8_t, k8_t, acc_s, transpose_B=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_s, num_regs=k.s_regs)

    @T.macro
    def pv8(kv8, p8, acc_o, alpha_slots, g):
        """acc_o (O^T as four m64n64 tiles, acc_o_layout) = its columns times block g's alpha (its slot in
        ``alpha_slots``), then += V^T P8^T with V^T [256 dims, 64 tokens] built in registers from the K8 tile kv8
        [64 tokens, 256 dims]. Plain addresses: TileLang adds no barrier; the slot's pointer is built here, as a
        macro argument it would be let-bound to a handle, which TileLang 0.1.9's thread-sync pass cannot compare."""
        T.evaluate(T.call_extern("handle", "mla_pv8_vt", acc_o.data, T.address_of(kv8[0, 0]),
                                 T.address_of(p8[0, 0]), T.address_of(alpha_slots[0]), alpha_slot(g) * k.block_rows))

    return SimpleNamespace(produce_segment=produce_segment, score8=score8, pv8=pv8)


def fp8c_program(k, c, e, num_parts, batch, prelude: str):
    """The split program (kernel.build_decode_kernel's macro, same arguments) of the fp8-compute ws kernel: its
    shared tiles, barriers and one role per warpgroup (c, e: the 16-bit kernel's consumer and epilogue macros;
    ``num_parts`` and ``batch``: the plan's dimensions; ``prelude``: protocol.PRELUDE, the trace prelude where
    ``KernelConfig.trace_part`` is set, then fp8c_prelude())."""
    r = fp8c_roles(k, c, e, fp8c_macros(k))
    accum, block_n, block_rows, q_rows = k.accum, k.block_n, k.block_rows, k.q_rows
    e4m3 = "float8_e4m3"

    def tiles(n_rows):
        """Shared e4m3 tiles (left [n_rows, 256], right [n_rows, 256], rope [n_rows, 64]): Q8, or one K8 buffer."""
        return (T.alloc_shared([n_rows, HALF], e4m3), T.alloc_shared([n_rows, HALF], e4m3),
                T.alloc_shared([n_rows, ROPE_DIM], e4m3))

    @T.macro
    def split_program(q_nope, q_pe, kv_cache, k_scale, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                      part_begin_req, part_end_req, part_start, req_parts, sm_scale, out, lse, out_partial, lse_partial):
        with kernel_launch(num_parts, k.n_row_blocks, threads=k.threads, prelude=prelude) as (part, row_block):
            q8_l, q8_r, q8_t = tiles(q_rows)
            kv80_l, kv80_r, k80_t = tiles(block_n)  # the two K8 buffers
            kv81_l, kv81_r, k81_t = tiles(block_n)
            p8 = T.alloc_shared([q_rows, block_n], e4m3)
            # no TileLang GEMM reads P8: the layout (64-byte swizzle, K-major) that the P V's B descriptor names
            from tilelang.layout import make_wgmma_swizzled_layout
            T.annotate_layout({p8: make_wgmma_swizzled_layout(p8, k_major=True)})
            qscale = T.alloc_shared([q_rows], accum)
            # alpha by alpha_slot(g), as in the 16-bit kernel (WG0 stores it after its p_free wait here, so the
            # simulation in tests/test_lowering_fp8c.py passes with one slot too)
            alpha_slots = T.alloc_shared([2 * block_rows], accum)
            l_shared = T.alloc_shared([q_rows], accum)  # l for WG1
            acc_s = T.alloc_fragment([block_rows, block_n], accum)
            acc_o_l = T.alloc_fragment([block_rows, HALF], accum)
            acc_o_r = T.alloc_fragment([block_rows, HALF], accum)
            T.annotate_layout({acc_o_l: acc_o_layout(block_rows, 0), acc_o_r: acc_o_layout(block_rows, 1)})
            m_prev = T.alloc_fragment([q_rows], accum)
            m_cur = T.alloc_fragment([q_rows], accum)
            alpha = T.alloc_fragment([q_rows], accum)
            row_sum = T.alloc_fragment([q_rows], accum)
            l_sum = T.alloc_fragment([q_rows], accum)
            q_scale_r = T.alloc_fragment([q_rows], accum)
            l_r = T.alloc_fragment([q_rows], accum)
            lc = T.alloc_local([16], accum)  # l of a consumer thread's 16 O^T columns
            alpha_r = T.alloc_fragment([q_rows], accum)
            qraw = T.alloc_local([9, 8], k.dtype)  # producer: 9 chunks of a Q row
            k_ready = T.alloc_barrier([128, 128])
            k_free = T.alloc_barrier([256, 256])
            q_ready = T.alloc_barrier(128)
            q_free = T.alloc_barrier(128)
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            l_ready = T.alloc_barrier(128)
            l_free = T.alloc_barrier(128)
            seg = T.alloc_var("int32")

            tx = T.get_thread_binding()
            wait_for_inputs(k.cfg.pdl)
            if k.tracing:  # KernelConfig.trace_part: the record goes to out_partial's last slot, which no plan uses
                T.evaluate(T.call_extern("handle", "mla_trace_begin",
                                         T.access_ptr(out_partial[out_partial.shape[0] - 1, 0, 0], "w")))
            row0 = row_block * block_rows
            part_lo = part_start[part]
            part_hi = part_start[part + 1]
            kv_scale = k_scale[0]
            scale_log2 = sm_scale[0] * kv_scale * LOG2E
            seg = 0
            if tx < 128:
                r.wg0(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                      q8_l, q8_r, q8_t, qscale, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t, p8, alpha_slots, l_shared,
                      acc_s, acc_o_l, m_prev, m_cur, alpha, row_sum, l_sum, q_scale_r, k_ready, k_free, q_ready, q_free,
                      p_ready, p_free, l_ready, l_free, seg, row0, req_parts, part_lo, part_hi, kv_scale, scale_log2,
                      part, lc)
            elif tx < 256:
                r.wg1(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                      kv80_r, kv81_r, p8, alpha_slots, l_shared, acc_o_r, l_r, alpha_r, k_ready, k_free, p_ready,
                      p_free, l_ready, l_free, seg, row0, req_parts, part_lo, part_hi, kv_scale, part, lc)
            else:
                r.producer(q_nope, q_pe, kv_cache, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                           part_begin_req, part_end_req, q8_l, q8_r, q8_t, qscale, qraw, kv80_l, kv80_r, k80_t,
                           kv81_l, kv81_r, k81_t, k_ready, k_free, q_ready, q_free, seg, tx - 256, part_lo, part_hi,
                           row0, part)

    return split_program
