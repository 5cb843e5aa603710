"""The consumer warpgroups' building blocks: S = Q K^T (tws: S^T = K Q^T), the causal / length mask, P V.

WG0 computes S, the online softmax and P, and O[:, :256]; WG1 O[:, 256:] from P in shared memory (roles.py).
"""

from types import SimpleNamespace

import tilelang.language as T

from ...constants import ROPE_DIM
from .protocol import (HALF, PART_L, PART_R, PART_T, TWS_TILE, WG0_NAMED_BARRIER, kv_buffer, kv_ready_parity,
                       part_barrier)


def consumer_macros(k):
    """The consumers' macros for variant ``k`` (kernel.variant_spec): S, the mask, P V."""
    accum, block_n, block_rows, cdtype, num_heads, q_rows, rows, s_regs, tile_ready, trace, transposed = (
        k.accum, k.block_n, k.block_rows, k.cdtype, k.num_heads, k.q_rows, k.rows, k.s_regs, k.tile_ready, k.trace,
        k.transposed)

    @T.macro
    def score_tile(q, kv, g, part, k_ready, acc_s):
        """S += Q K^T over one tile of block g's buffer, once that tile has landed (tile_ready)."""
        T.barrier_wait(k_ready[part_barrier(g, part)], kv_ready_parity(g))
        T.wgmma_gemm(q, kv, acc_s, transpose_B=True)

    @T.macro
    def score(q_l, q_r, q_t, kv_l, kv_r, k_t, g, k_ready, acc_s):
        """S = Q K^T (rows x tokens); tws: S^T = K Q^T (tokens x rows); tile_ready (left, right, rope): each tile's
        WGMMA issued as soon as that tile of block g has landed, in the order the producer fills them in."""
        T.clear(acc_s)
        if transposed:
            T.wgmma_gemm(kv_l, q_l, acc_s, transpose_B=True)
            T.wgmma_gemm(kv_r, q_r, acc_s, transpose_B=True)
            T.wgmma_gemm(k_t, q_t, acc_s, transpose_B=True)
        elif tile_ready:
            score_tile(q_l, kv_l, g, PART_L, k_ready, acc_s)
            score_tile(q_r, kv_r, g, PART_R, k_ready, acc_s)
            score_tile(q_t, k_t, g, PART_T, k_ready, acc_s)
        else:
            T.wgmma_gemm(q_l, kv_l, acc_s, transpose_B=True)
            T.wgmma_gemm(q_r, kv_r, acc_s, transpose_B=True)
            T.wgmma_gemm(q_t, k_t, acc_s, transpose_B=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_s, num_regs=s_regs)  # S is read after the wait, not before

    @T.macro
    def score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s):
        """S = Q K^T over the KV buffer holding block g, once the block has landed (tile_ready: per tile, in
        score)."""
        if not tile_ready:
            T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
        trace(0, g, 1)
        if kv_buffer(g) == 0:
            score(q_l, q_r, q_t, kv0_l, kv0_r, k0_t, g, k_ready, acc_s)
        else:
            score(q_l, q_r, q_t, kv1_l, kv1_r, k1_t, g, k_ready, acc_s)

    @T.macro
    def pv_block(p, g, v0, v1, acc_o):
        """acc_o += P V, V being this warpgroup's half of the KV buffer holding block g (tws: O^T += V^T P^T,
        V read MN-major from the same tile, P [rows, tokens] as the K-major B operand)."""
        if transposed:
            if kv_buffer(g) == 0:
                T.gemm(v0, p, acc_o, transpose_A=True, transpose_B=True)
            else:
                T.gemm(v1, p, acc_o, transpose_A=True, transpose_B=True)
        elif kv_buffer(g) == 0:
            T.gemm(p, v0, acc_o)
        else:
            T.gemm(p, v1, acc_o)

    @T.macro
    def mask_scale(acc_s, pos0, vis0, row0, scale_log2):
        """Scale S to the log2 domain; -inf where the causal / length rule hides a position."""
        if pos0 + block_n <= vis0 + row0 // num_heads:
            # every position of the block is visible to every row of the tile
            for i, j in T.Parallel(block_rows, block_n):
                acc_s[i, j] = acc_s[i, j] * scale_log2
        else:
            for i, j in T.Parallel(block_rows, block_n):
                acc_s[i, j] = T.if_then_else(pos0 + j < vis0 + (row0 + i) // num_heads,
                                             acc_s[i, j] * scale_log2, -T.infinity(accum))

    @T.macro
    def pv_quarters(p, v, acc0, acc1, acc2, acc3):
        """tws WG1: O^T[256:] += V^T P^T as four 64-dim WGMMA tiles (see the allocation), one wait."""
        T.wgmma_gemm(v[:, 0:TWS_TILE], p, acc0, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, TWS_TILE:2 * TWS_TILE], p, acc1, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, 2 * TWS_TILE:3 * TWS_TILE], p, acc2, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, 3 * TWS_TILE:HALF], p, acc3, transpose_A=True, transpose_B=True)
        T.wait_wgmma(0)

    @T.macro
    def mask_scale_t(acc_s, pos0, vis0, scale_log2):
        """tws: mask_scale on S^T (tokens x rows; one row block, row0 = 0)."""
        if pos0 + block_n <= vis0:
            for j, i in T.Parallel(block_n, q_rows):
                acc_s[j, i] = acc_s[j, i] * scale_log2
        else:
            for j, i in T.Parallel(block_n, q_rows):
                acc_s[j, i] = T.if_then_else(pos0 + j < vis0 + i // num_heads, acc_s[j, i] * scale_log2,
                                             -T.infinity(accum))

    @T.macro
    def zero_pad_rows(q_l, q_r, q_t, row0, barrier_id):
        """Rows past `rows` (last row block only) stay zero in Q for the whole program: the producer only
        ever writes the valid rows (disjoint bytes). Generic stores read by WGMMA (async proxy): fence,
        then every warp of this warpgroup has its zeros in place before its first WGMMA."""
        for i, d in T.Parallel(q_rows, HALF):
            if row0 + i >= rows:
                q_l[i, d] = T.cast(0, cdtype)
                q_r[i, d] = T.cast(0, cdtype)
        for i, d in T.Parallel(q_rows, ROPE_DIM):
            if row0 + i >= rows:
                q_t[i, d] = T.cast(0, cdtype)
        T.fence_proxy_async()
        T.sync_threads(barrier_id, 128)

    @T.macro
    def q_bf16_to_f16(q_l, q_r, q_t, t):
        """WG0, after q_ready: the segment's bf16 Q (copied bit for bit into the fp16 tiles) -> fp16 x 2^-8,
        in place, 16 bytes per call; padding rows are zeros in both formats. Then as in zero_pad_rows."""
        for m in T.serial(q_rows // 4):
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16",
                                     T.access_ptr(q_l[m * 4 + t // 32, (t % 32) * 8], "rw", 8)))
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16",
                                     T.access_ptr(q_r[m * 4 + t // 32, (t % 32) * 8], "rw", 8)))
        for m in T.serial(q_rows // 16):
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16",
                                     T.access_ptr(q_t[m * 16 + t // 8, (t % 8) * 8], "rw", 8)))
        T.fence_proxy_async()
        T.sync_threads(WG0_NAMED_BARRIER, 128)


    def rescale_needed(alpha_frag):
        """ws consumers: some row of this thread has alpha != 1 (the m64 accumulator layout gives a thread 2 rows)."""
        return T.call_extern("int32", "mla_rescale_needed", alpha_frag.data, 2) != 0

    @T.macro
    def rescale_rows(acc, alpha_frag):
        """ws consumers: acc [64 rows, 256] *= alpha per row, skipped where this thread's rows all have alpha 1."""
        if rescale_needed(alpha_frag):
            for i, d in T.Parallel(block_rows, HALF):
                acc[i, d] *= alpha_frag[i]

    return SimpleNamespace(score_tile=score_tile, score=score, score_block=score_block, pv_block=pv_block,
                           mask_scale=mask_scale, pv_quarters=pv_quarters, mask_scale_t=mask_scale_t,
                           zero_pad_rows=zero_pad_rows, q_bf16_to_f16=q_bf16_to_f16, rescale_needed=rescale_needed,
                           rescale_rows=rescale_rows)
