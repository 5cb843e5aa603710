"""The warpgroup roles of the fp8-compute ws kernel (fp8c.py), each one request walk of a program (part, row block).

WG0: S on e4m3 WGMMA, the online softmax, P8 and O^T[:256] (the LSE too); WG1: O^T[256:]; the producer: Q8 and the
K8 blocks. Same request walk, segment numbering and parities as the 16-bit ws roles (roles.py); the accumulators are
O^T, so every per-row scale (alpha, 1 / l) goes to the thread's 16 O^T columns.
"""

from types import SimpleNamespace

import tilelang.language as T

from ..common import LN2, partial_lse, request_inputs, segment_span
from .protocol import (HALF, P8_SCALE, SEG_TRACE_STEP, WG0_NAMED_BARRIER, alpha_slot, grows, kv_buffer,
                       kv_ready_parity, p_free_parity, p_ready_parity, seg_ready_parity, segment_first_block)
from .roles import wg0_segment


def fp8c_roles(k, c, e, f):
    """WG0, WG1 and the producer of variant ``k`` (c, e: the 16-bit kernel's consumer and epilogue macros; f:
    fp8c.fp8c_macros), as a namespace (wg0, wg1, producer)."""
    accum, block_n, block_rows, q_len = k.accum, k.block_n, k.block_rows, k.q_len
    num_heads, q_rows, rows = k.num_heads, k.q_rows, k.rows
    mask_scale, trace, trace_end = c.mask_scale, k.trace, k.trace_end
    score8, pv8, produce_segment = f.score8, f.pv8, f.produce_segment
    out_kind = 1 if k.dtype == "bfloat16" else 2  # mla_ot_store's kOut for ``out`` (bf16 or fp16)

    def make_store_t(col0: int, with_lse: bool):
        """A consumer's segment end for O^T (its dims col0 .. col0 + 256), once ``lc`` holds l of the thread's 16
        columns: normalise per column, write each row's dims (make_store_segment's order of steps; fp8c.cuh's
        mla_ot_*). WG0 (``with_lse``) also writes the LSE from its row-layout l and m (``l_row``, ``m_row``) as
        make_store_rows does."""

        @T.macro
        def store_t(acc, lc, l_row, m_row, kv_scale, req_parts, part, req, row0, tok0, out, lse, out_partial,
                    lse_partial):
            T.evaluate(T.call_extern("handle", "mla_ot_normalize", acc.data, lc.data, kv_scale))
            if e.store_direct(req_parts, req):
                T.evaluate(T.call_extern("handle", f"mla_ot_store<{out_kind}>", acc.data,
                                         T.access_ptr(out[tok0, 0, col0], "w"), row0, rows - row0))
                if with_lse:
                    for i in T.Parallel(block_rows):
                        if row0 + i < rows:
                            lse[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads] = T.if_then_else(
                                l_row[i] == 0, -T.infinity(accum), (T.log2(l_row[i]) + m_row[i]) * LN2)
            else:
                T.evaluate(T.call_extern("handle", "mla_ot_store<0>", acc.data,
                                         T.access_ptr(out_partial[part + req, row0, col0], "w"), 0, rows - row0))
                if with_lse:
                    for i in T.Parallel(block_rows):
                        if row0 + i < rows:
                            lse_partial[part + req, row0 + i] = partial_lse(l_row[i], m_row[i])

        return store_t

    store_t_left, store_t_right = make_store_t(0, True), make_store_t(HALF, False)

    @T.macro
    def load_cols(l_shared, lc):
        """The thread's 16 columns of l from ``l_shared`` (plain addresses)."""
        T.evaluate(T.call_extern("handle", "mla_ot_cols", lc.data, T.address_of(l_shared[0])))

    @T.macro
    def zero_pad_q8(q8_l, q8_r, q8_t, qscale, row0):
        """Rows past ``rows`` (last row block only): zeros in Q8 and scale 1 for the whole program (the producer never
        writes them); fenced for WGMMA and in place in every WG0 warp before its first S."""
        for i, d in T.Parallel(q_rows, HALF):
            if row0 + i >= rows:
                q8_l[i, d] = T.cast(0, "float8_e4m3")
                q8_r[i, d] = T.cast(0, "float8_e4m3")
        for i, d in T.Parallel(q_rows, 64):
            if row0 + i >= rows:
                q8_t[i, d] = T.cast(0, "float8_e4m3")
        for i in T.Parallel(q_rows):
            if row0 + i >= rows:
                qscale[i] = T.float32(1)
        T.fence_proxy_async()
        T.sync_threads(WG0_NAMED_BARRIER, 128)

    @T.macro
    def wg0(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
            q8_l, q8_r, q8_t, qscale, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t, p8, alpha_slots, l_shared, acc_s,
            acc_o_l, m_prev, m_cur, alpha, row_sum, l_sum, q_scale_r, k_ready, k_free, q_ready, q_free, p_ready, p_free,
            l_ready, l_free, seg: T.Ref, row0, req_parts, part_lo, part_hi, kv_scale, scale_log2, part, lc):
        """WG0: S, the softmax, P8, O^T[:256]."""
        T.set_max_nreg(k.regs_wg0, 1)
        if k.pad_rows:
            zero_pad_q8(q8_l, q8_r, q8_t, qscale, row0)
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                tok0, vis0, g0, n_blk = wg0_segment(kv_lens, qo_indptr, q_len, req, part_lo, req_lo, blk_lo, blk_hi)
                T.fill(acc_o_l, 0)
                T.fill(l_sum, 0)
                T.fill(m_cur, -T.infinity(accum))
                trace(0, g0, SEG_TRACE_STEP)  # the segment's start: the previous one's epilogue is done
                T.barrier_wait(q_ready[0], seg_ready_parity(seg))
                for i in T.Parallel(block_rows):
                    q_scale_r[i] = qscale[i] * scale_log2
                for blk in T.serial(n_blk):
                    g = g0 + blk
                    pos0 = (blk_lo + blk) * block_n
                    trace(0, g, 0)
                    T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
                    trace(0, g, 1)
                    if kv_buffer(g) == 0:
                        score8(q8_l, q8_r, q8_t, kv80_l, kv80_r, k80_t, acc_s)
                    else:
                        score8(q8_l, q8_r, q8_t, kv81_l, kv81_r, k81_t, acc_s)
                    trace(0, g, 2)
                    if blk == n_blk - 1:
                        T.barrier_arrive(q_free[0])  # last read of this segment's Q8 and scales
                    mask_scale(acc_s, pos0, vis0, row0, T.float32(1.0))
                    for i, j in T.Parallel(block_rows, block_n):
                        acc_s[i, j] = acc_s[i, j] * q_scale_r[i]  # log2 units; -inf stays -inf (scales > 0)
                    T.copy(m_cur, m_prev)
                    T.evaluate(T.call_extern("handle", "mla_row_max2", acc_s.data, m_cur.data, T.float32(1.0)))
                    # alpha scales O^T's columns inside pv8, from the slot stored below
                    for i in T.Parallel(block_rows):
                        alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1, T.exp2(m_prev[i] - m_cur[i]))
                    for i, j in T.Parallel(block_rows, block_n):
                        acc_s[i, j] = T.exp2(acc_s[i, j] - T.if_then_else(m_cur[i] == -T.infinity(accum), 0,
                                                                          m_cur[i]))
                    T.evaluate(T.call_extern("handle", "mla_row_sum_part", acc_s.data, row_sum.data))
                    for i in T.Parallel(block_rows):
                        l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                    trace(0, g, 3)
                    # P8(g - 1) is still WG1's until its p_free arrival
                    T.barrier_wait(p_free[0], p_free_parity(g))
                    trace(0, g, 4)
                    T.evaluate(T.call_extern("handle", "mla_store_rows64",
                                             alpha_slots.access_ptr("r", offset=alpha_slot(g) * block_rows),
                                             alpha.data))
                    # each 16-token group's columns in the ldmatrix token order (a thread's four tokens of a group
                    # as one word), the order pv8's V^T fragments give the tokens
                    T.evaluate(T.call_extern("handle", "mla_p8_store_ldsm", acc_s.data, T.address_of(p8[0, 0]),
                                             T.float32(P8_SCALE)))
                    T.fence_proxy_async()
                    T.sync_threads(WG0_NAMED_BARRIER, 128)  # every WG0 warp's P8 in place before its WGMMA
                    T.barrier_arrive(p_ready[0])
                    trace(0, g, 5)
                    # the alpha slot's stores are in place after WG0's named barrier; WG0 rewrites the slot two
                    # blocks on, after another named barrier every WG0 thread reaches after this read
                    if kv_buffer(g) == 0:
                        pv8(kv80_l, p8, acc_o_l, alpha_slots, g)
                    else:
                        pv8(kv81_l, p8, acc_o_l, alpha_slots, g)
                    trace(0, g, 6)
                    T.barrier_arrive(k_free[kv_buffer(g)])

                T.evaluate(T.call_extern("handle", "mla_quad_sum2", l_sum.data))
                # l to WG1 through l_shared; WG0 reads its columns back after its named barrier (l_shared is
                # rewritten at the next segment's end, after more named barriers)
                e.send_l(l_sum, l_shared, l_free, l_ready, seg)
                T.sync_threads(WG0_NAMED_BARRIER, 128)
                load_cols(l_shared, lc)
                store_t_left(acc_o_l, lc, l_sum, m_cur, kv_scale / P8_SCALE, req_parts, part, req, row0, tok0, out,
                             lse, out_partial, lse_partial)
                seg = seg + 1
        trace_end(0)

    @T.macro
    def wg1(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial, kv80_r, kv81_r,
            p8, alpha_slots, l_shared, acc_o_r, l_r, alpha_r, k_ready, k_free, p_ready, p_free, l_ready, l_free,
            seg: T.Ref, row0, req_parts, part_lo, part_hi, kv_scale, part, lc):
        """WG1: O^T[256:] from P8 and its K8 tile."""
        T.set_max_nreg(k.regs_wg1, grows(k.regs_wg1, k.threads))
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                tok0 = qo_indptr[req]
                g0 = segment_first_block(part_lo, req_lo, blk_lo)
                T.fill(acc_o_r, 0)
                for blk in T.serial(blk_hi - blk_lo):
                    g = g0 + blk
                    trace(1, g, 0)
                    T.barrier_wait(p_ready[0], p_ready_parity(g))
                    trace(1, g, 1)
                    T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
                    trace(1, g, 2)
                    if kv_buffer(g) == 0:
                        pv8(kv80_r, p8, acc_o_r, alpha_slots, g)
                    else:
                        pv8(kv81_r, p8, acc_o_r, alpha_slots, g)
                    trace(1, g, 3)
                    T.barrier_arrive(p_free[0])
                    T.barrier_arrive(k_free[kv_buffer(g)])

                # WG0's l of the thread's columns, read before l_free hands l_shared back
                T.barrier_wait(l_ready[0], seg_ready_parity(seg))
                trace(1, g0, SEG_TRACE_STEP)  # WG0's l has come: WG1's epilogue starts
                load_cols(l_shared, lc)
                T.barrier_arrive(l_free[0])
                store_t_right(acc_o_r, lc, l_r, l_r, kv_scale / P8_SCALE, req_parts, part, req, row0, tok0, out, lse,
                              out_partial, lse_partial)
                seg = seg + 1
        trace_end(1)

    @T.macro
    def producer(q_nope, q_pe, kv_cache, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks, part_begin_req,
                 part_end_req, q8_l, q8_r, q8_t, qscale, qraw, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t, k_ready,
                 k_free, q_ready, q_free, seg: T.Ref, t, part_lo, part_hi, row0, part):
        """The producer: per request segment Q8 and the blocks. It waits for each of its copies itself, so none is in
        flight at its exit."""
        T.set_max_nreg(k.regs_producer, grows(k.regs_producer, k.threads))
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                kv_len, tok0, pt0 = request_inputs(kv_lens, qo_indptr, page_table_start, req)
                g0 = segment_first_block(part_lo, req_lo, blk_lo)
                produce_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg,
                                q8_l, q8_r, q8_t, qscale, qraw, kv80_l, kv80_r, k80_t, kv81_l, kv81_r, k81_t, q_free,
                                q_ready, k_free, k_ready, t)
                seg = seg + 1
        trace_end(2)

    return SimpleNamespace(wg0=wg0, wg1=wg1, producer=producer)
