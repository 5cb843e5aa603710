"""The warpgroup roles of the Hopper decode, each one request walk of a program (part, row block).

WG0: S, the online softmax and P, and O[:, :256] (the LSE too); WG1: O[:, 256:] from P in shared memory; the producer
(one warpgroup, two for tws with an fp8 cache): Q and the KV blocks. ``tws`` (transposed, h x q_len <= 16) and ``ws``
consumers keep the same protocol (protocol.py); kernel.py allocates the buffers and calls one role per warpgroup.
"""

import tilelang.language as T

from ...constants import HEAD_DIM, KV_LORA_RANK
from ..common import request_inputs, segment_span
from .protocol import (HALF, PART_R, TWS_TILE, WG0_NAMED_BARRIER, alpha_slot, grows, kv_buffer, kv_ready_parity,
                       p_free_parity, p_ready_parity, part_barrier, seg_ready_parity, segment_first_block)


@T.macro
def wg0_segment(kv_lens, qo_indptr, q_len, req, part_lo, req_lo, blk_lo, blk_hi):
    """What WG0 needs of a request segment, as let-bound values: the request's first query token ``tok0``, ``vis0``
    (row r sees KV positions < vis0 + r // H: causal over the request's q_len queries), g of the segment's first block
    and its number of blocks."""
    tok0 = qo_indptr[req]
    vis0 = kv_lens[req] - q_len + 1
    g0 = segment_first_block(part_lo, req_lo, blk_lo)
    n_blk = blk_hi - blk_lo
    return tok0, vis0, g0, n_blk


def wg0_roles(k, c, e, p):
    """WG0 of variant ``k`` (c, e, p: the consumer, epilogue and producer macros): (tws, ws)."""
    accum, block_n, block_rows = k.accum, k.block_n, k.block_rows
    pad_rows, q_len = k.pad_rows, k.q_len
    q_rows, q_to_f16, regs_wg0 = k.q_rows, k.q_to_f16, k.regs_wg0
    threads, trace, trace_end = k.threads, k.trace, k.trace_end
    mask_scale, mask_scale_t, pv_block = c.mask_scale, c.mask_scale_t, c.pv_block
    q_bf16_to_f16, score_block, zero_pad_rows = c.q_bf16_to_f16, c.score_block, c.zero_pad_rows
    release_kv, wg0_end_segment = p.release_kv, e.wg0_end_segment

    @T.macro
    def segment_start(acc_o, l_part, m_cur, q_ready, seg: T.Ref, q_l, q_r, q_t, tx):
        """WG0, a segment's start: O, the row sums and the running max reset, then the wait for the segment's Q
        (converted to fp16 x 2^-8 in place for an fp8 cache under a bf16 q)."""
        T.fill(acc_o, 0)
        T.fill(l_part, 0)
        T.fill(m_cur, -T.infinity(accum))
        T.barrier_wait(q_ready[0], seg_ready_parity(seg))
        if q_to_f16:
            q_bf16_to_f16(q_l, q_r, q_t, tx)

    @T.macro
    def wg0_tws(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, p_shared, colmax_s, alpha_shared,
                l_shared, acc_s, acc_o_l, l_acc, m_prev, m_cur, alpha, l_sum, k_ready,
                k_free, q_ready, q_free, p_ready, p_free, l_ready, l_free, seg: T.Ref, tx, row0, req_parts, part_lo, part_hi,
                kv_scale, scale_log2, part):
        """tws WG0: S^T, softmax down the columns, P, O^T[:256]. Same protocol as ws WG0; the running max is a
        cross-warp reduction per block, the row sums stay per thread (l_acc, rescaled like O) until the segment's end."""
        # Same protocol as WG0 below; the running max is a cross-warp reduction per block, the row
        # sums stay per thread (l_acc, rescaled like O) until the segment's end.
        T.set_max_nreg(regs_wg0, grows(regs_wg0, threads))
        if pad_rows:
            zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER)
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                tok0, vis0, g0, n_blk = wg0_segment(kv_lens, qo_indptr, q_len, req, part_lo, req_lo, blk_lo, blk_hi)
                segment_start(acc_o_l, l_acc, m_cur, q_ready, seg, q_l, q_r, q_t, tx)
                for blk in T.serial(n_blk):
                    g = g0 + blk
                    score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s)
                    if blk == n_blk - 1:
                        T.barrier_arrive(q_free[0])
                    mask_scale_t(acc_s, (blk_lo + blk) * block_n, vis0, scale_log2)
                    T.copy(m_cur, m_prev)
                    # the scratch by plain address: its two halves alternate by block, so no barrier
                    # is needed before the write (TileLang's thread-sync pass would add one)
                    T.evaluate(T.call_extern("handle", "mla_colmax4", acc_s.data,
                                             m_cur.data, T.address_of(colmax_s[0]), g & 1))
                    for i in T.Parallel(q_rows):
                        alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1,
                                                  T.exp2(m_prev[i] - m_cur[i]))
                    for j, i in T.Parallel(block_n, q_rows):
                        acc_s[j, i] = T.exp2(acc_s[j, i]
                                             - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
                        l_acc[j, i] = l_acc[j, i] * alpha[i] + acc_s[j, i]
                    T.barrier_wait(p_free[0], p_free_parity(g))
                    for i in T.Parallel(q_rows):
                        alpha_shared[i] = alpha[i]
                    for j, i in T.Parallel(block_n, q_rows):
                        p_shared[i, j] = acc_s[j, i]
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready[0])
                    for d, i in T.Parallel(HALF, q_rows):
                        acc_o_l[d, i] *= alpha[i]
                    pv_block(p_shared, g, kv0_l, kv1_l, acc_o_l)
                    T.barrier_arrive(k_free[kv_buffer(g)])

                T.reduce_sum(l_acc, l_sum, dim=0)
                wg0_end_segment(acc_o_l, l_sum, m_cur, alpha, l_shared, l_free, l_ready, seg, kv_scale, req_parts,
                                part, req, row0, tok0, out, lse, out_partial, lse_partial)
                seg = seg + 1

    @T.macro
    def wg0_ws(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, p_shared, alpha_shared,
                alpha_slots, p_frag, l_shared, acc_s, acc_o_l, m_prev, m_cur, alpha,
                row_sum, l_sum, k_ready, k_free, q_ready, q_free, p_ready, p_free, l_ready, l_free, seg: T.Ref, tx, row0,
                req_parts, part_lo, part_hi, kv_scale, scale_log2, part):
        """ws WG0: S, softmax, P, O[:, :256]."""
        T.set_max_nreg(regs_wg0, 1)
        if pad_rows:
            zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER)  # WG0 is Q's only reader
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                kv_len = kv_lens[req]
                tok0 = qo_indptr[req]
                vis0 = kv_len - q_len + 1  # row r sees positions < vis0 + r // H
                g0 = segment_first_block(part_lo, req_lo, blk_lo)  # g of the segment's first block
                n_blk = blk_hi - blk_lo
                segment_start(acc_o_l, l_sum, m_cur, q_ready, seg, q_l, q_r, q_t, tx)
                for blk in T.serial(n_blk):
                    g = g0 + blk
                    pos0 = (blk_lo + blk) * block_n
                    trace(0, g, 0)
                    score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s)
                    trace(0, g, 2)
                    if blk == n_blk - 1:
                        T.barrier_arrive(q_free[0])  # last read of this segment's Q
                    # WG1's P V (g - 1) ran before S (g) on the tensor pipe: the wait for its release of P is
                    # due, and no wait (a branch) then splits the softmax for ptxas's scheduler
                    T.barrier_wait(p_free[0], p_free_parity(g))
                    # S stays raw (scale 1 here): the row max and P's exp2 apply the scale (one FFMA per element)
                    mask_scale(acc_s, pos0, vis0, row0, T.float32(1.0))
                    T.copy(m_cur, m_prev)
                    # S's row max by a 4-level tree per thread (TileLang's reduce_max is a 16-deep chain)
                    T.evaluate(T.call_extern("handle", "mla_row_max2", acc_s.data, m_cur.data, scale_log2))
                    # A row that has seen nothing yet keeps max -inf: offset by 0 instead, so
                    # exp2 gives 0, not NaN.
                    for i in T.Parallel(block_rows):
                        alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1,
                                                  T.exp2(m_prev[i] - m_cur[i]))
                    # O's rescale right after alpha, unconditional: ptxas interleaves its multiplies with P's exp2s
                    for i, d in T.Parallel(block_rows, HALF):
                        acc_o_l[i, d] *= alpha[i]
                    for i, j in T.Parallel(block_rows, block_n):
                        acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2
                                             - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
                    # P V from P in registers (WG0's half; FlashAttention-3's first consumer for head_dim_v 512)
                    T.copy(acc_s, p_frag)
                    # alpha's slot was last read by WG1 for block g - 2, before the p_free arrival WG0 waited for
                    # at block g - 1. A read-only access_ptr: TileLang's thread-sync pass would put a barrier of the
                    # warpgroup around a store it can see.
                    T.evaluate(T.call_extern("handle", "mla_store_rows64",
                                             alpha_slots.access_ptr("r", offset=alpha_slot(g) * block_rows),
                                             alpha.data))
                    trace(0, g, 3)
                    trace(0, g, 4)
                    # P's copy for WG1 by a read-only access_ptr, or TileLang's fence-proxy pass would take the call
                    # for a generic write and fence it before WG0's GEMM (the fence follows it)
                    T.evaluate(T.call_extern("handle", "mla_store_p64", p_shared.access_ptr("r"), p_frag.data))
                    if kv_buffer(g) == 0:
                        T.wgmma_gemm(p_frag, kv0_l, acc_o_l)
                    else:
                        T.wgmma_gemm(p_frag, kv1_l, acc_o_l)
                    # FlashAttention-3's order: the fence (it waits for P's stores) and p_ready behind WG0's GEMM
                    T.fence_proxy_async()
                    T.barrier_arrive(p_ready[0])
                    trace(0, g, 5)
                    # the row sums (this thread's share) while the tensor cores run
                    T.evaluate(T.call_extern("handle", "mla_row_sum_part", acc_s.data, row_sum.data))
                    for i in T.Parallel(block_rows):
                        l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                    trace(0, g, 6)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_o_l, num_regs=block_rows * HALF // 128)
                    trace(0, g, 7)
                    release_kv(k_free, g, tx)

                # each thread held its share of the row sums
                T.evaluate(T.call_extern("handle", "mla_quad_sum2", l_sum.data))
                wg0_end_segment(acc_o_l, l_sum, m_cur, alpha, l_shared, l_free, l_ready, seg, kv_scale, req_parts,
                                part, req, row0, tok0, out, lse, out_partial, lse_partial)
                seg = seg + 1
        trace_end(0)

    return wg0_tws, wg0_ws


def wg1_roles(k, c, e, p):
    """WG1 of variant ``k`` (tws, ws) and its producer warpgroup(s): (wg1_tws, wg1_ws, producer)."""
    block_rows, q_rows = k.block_rows, k.q_rows
    regs_wg1, rs_pv, store_right_t = k.regs_wg1, k.rs_pv, k.store_right_t
    threads, tile_ready, trace = k.threads, k.tile_ready, k.trace
    trace_end = k.trace_end
    receive_l, store_direct, wg1_store_segment = e.receive_l, e.store_direct, e.wg1_store_segment
    pv_block, pv_quarters, rescale_rows = c.pv_block, c.pv_quarters, c.rescale_rows
    release_kv = p.release_kv
    block_n, cluster_rope, is_fp8 = k.block_n, k.cluster_rope, k.is_fp8
    last_copy_barrier = k.last_copy_barrier
    rr_fp8, threads, tma_kv = k.rr_fp8, k.threads, k.tma_kv
    trace_end = k.trace_end
    produce_segment = p.produce_segment

    @T.macro
    def wg1_tws(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial, kv0_r, kv1_r,
                p_shared, alpha_shared, l_shared, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3, l_r, alpha_r, k_ready, k_free,
                p_ready, p_free, l_ready, l_free, seg: T.Ref, row0, req_parts, part_lo, part_hi, kv_scale, part):
        """tws WG1: O^T[256:] as four 64-dim tiles."""
        T.set_max_nreg(regs_wg1, grows(regs_wg1, threads))
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                tok0 = qo_indptr[req]
                g0 = segment_first_block(part_lo, req_lo, blk_lo)
                T.fill(acc_o_r0, 0)
                T.fill(acc_o_r1, 0)
                T.fill(acc_o_r2, 0)
                T.fill(acc_o_r3, 0)
                for blk in T.serial(blk_hi - blk_lo):
                    g = g0 + blk
                    T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
                    T.barrier_wait(p_ready[0], p_ready_parity(g))
                    for i in T.Parallel(q_rows):
                        alpha_r[i] = alpha_shared[i]
                    for d, i in T.Parallel(TWS_TILE, q_rows):
                        acc_o_r0[d, i] *= alpha_r[i]
                        acc_o_r1[d, i] *= alpha_r[i]
                        acc_o_r2[d, i] *= alpha_r[i]
                        acc_o_r3[d, i] *= alpha_r[i]
                    if kv_buffer(g) == 0:
                        pv_quarters(p_shared, kv0_r, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3)
                    else:
                        pv_quarters(p_shared, kv1_r, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3)
                    T.barrier_arrive(p_free[0])
                    T.barrier_arrive(k_free[kv_buffer(g)])

                receive_l(l_r, l_shared, l_ready, l_free, seg)
                direct = store_direct(req_parts, req)
                store_right_t[0].normalize(acc_o_r0, l_r, kv_scale, alpha_r)
                store_right_t[1].normalize(acc_o_r1, l_r, kv_scale, alpha_r)
                store_right_t[2].normalize(acc_o_r2, l_r, kv_scale, alpha_r)
                store_right_t[3].normalize(acc_o_r3, l_r, kv_scale, alpha_r)
                store_right_t[0].write(acc_o_r0, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                       out_partial, lse_partial)
                store_right_t[1].write(acc_o_r1, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                       out_partial, lse_partial)
                store_right_t[2].write(acc_o_r2, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                       out_partial, lse_partial)
                store_right_t[3].write(acc_o_r3, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                       out_partial, lse_partial)
                seg = seg + 1

    @T.macro
    def wg1_ws(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                kv0_r, kv1_r, p_shared, alpha_shared, alpha_slots, l_shared,
                acc_o_r, l_r, alpha_r, k_ready, k_free, p_ready, p_free, l_ready, l_free, seg: T.Ref, tx, row0, req_parts,
                part_lo, part_hi, kv_scale, part):
        """ws WG1: O[:, 256:] from P in shared memory."""
        T.set_max_nreg(regs_wg1, grows(regs_wg1, threads))  # fp8's 160 is a .dec
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                tok0 = qo_indptr[req]
                g0 = segment_first_block(part_lo, req_lo, blk_lo)
                T.fill(acc_o_r, 0)
                for blk in T.serial(blk_hi - blk_lo):
                    g = g0 + blk
                    trace(1, g, 0)
                    # its V half (tile_ready: that tile's own barrier)
                    T.barrier_wait(k_ready[part_barrier(g, PART_R) if tile_ready else kv_buffer(g)],
                                   kv_ready_parity(g))
                    trace(1, g, 1)
                    T.barrier_wait(p_ready[0], p_ready_parity(g))
                    trace(1, g, 2)
                    for i in T.Parallel(block_rows):
                        alpha_r[i] = (alpha_slots[alpha_slot(g) * block_rows + i] if rs_pv
                                      else alpha_shared[i])
                    rescale_rows(acc_o_r, alpha_r)
                    pv_block(p_shared, g, kv0_r, kv1_r, acc_o_r)
                    trace(1, g, 3)
                    T.barrier_arrive(p_free[0])
                    release_kv(k_free, g, tx)

                receive_l(l_r, l_shared, l_ready, l_free, seg)
                wg1_store_segment(acc_o_r, l_r, l_r, alpha_r, kv_scale, req_parts, part, req, row0, tok0, out, lse,
                                  out_partial, lse_partial)
                seg = seg + 1
        trace_end(1)

    @T.macro
    def producer(q_nope, q_pe, kv_cache, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks, part_begin_req,
                part_end_req, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, raw, pages, k_ready, k_free,
                q_ready, q_free, seg: T.Ref, t, pw, row0, part_lo, part_hi, part):
        """The producer warpgroup ``pw`` (thread ``t`` of it; kernel.py has set its registers): per request segment Q
        and the KV blocks, then the tail wait for its last copies."""
        if cluster_rope and part_hi < part_lo:
            # never taken: with every tile multicast, this tma_copy is what makes TileLang pass the cache's
            # tensor map (kv_cache_desc), which MLA_TMA_MC issues through
            T.tma_copy(kv_cache[0, 0:block_n, KV_LORA_RANK:HEAD_DIM], k0_t, barrier=k_ready[0])
        for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
            req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
            if blk_hi > blk_lo:
                kv_len, tok0, pt0 = request_inputs(kv_lens, qo_indptr, page_table_start, req)
                g0 = segment_first_block(part_lo, req_lo, blk_lo)
                produce_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi,
                                g0, seg, pw, pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t,
                                q_free, q_ready, k_free, k_ready, t)
                seg = seg + 1
        if rr_fp8:
            # Tail: producer 0's last Q copies have landed (the others issue no cp.async). Not the part's
            # last k_ready as below: a producer done early may be two fills ahead of that barrier.
            if pw == 0 and seg > 0:
                T.barrier_wait(q_ready[0], seg_ready_parity(seg - 1))
        elif part_hi > part_lo:
            # Tail: no producer thread exits with cp.async in flight. With only cp.async gathers the part's
            # last copy's k_ready phase is enough: it completes once all
            # 128 producer threads' copies have landed (a noinc arrival waits for all of its thread's earlier
            # cp.async, Q included). A TMA block's phase (bytes + plain arrivals) or an fp8 block's
            # (registers, plain arrivals) waits for none of them: then also the block before (a gather,
            # maybe) and the last segment's Q. (cp.async.wait_group would make TileLang add a named barrier
            # whose id collides with WG0's.)
            if tma_kv and part_hi - part_lo > 1:
                T.barrier_wait(k_ready[last_copy_barrier(part_hi - part_lo - 2)],
                               kv_ready_parity(part_hi - part_lo - 2))
            T.barrier_wait(k_ready[last_copy_barrier(part_hi - part_lo - 1)],
                           kv_ready_parity(part_hi - part_lo - 1))
            if tma_kv or is_fp8:
                T.barrier_wait(q_ready[0], seg_ready_parity(seg - 1))
        trace_end(2)

    return wg1_tws, wg1_ws, producer

