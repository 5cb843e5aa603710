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

An fp8 cache (``kv_dtype`` float8_e4m3fnuz on gfx942) is converted to ``dtype`` as its rows are gathered into
the 16-bit KV tiles, so it takes no more shared memory than a 16-bit cache; ``k_scale`` is applied to S and O.
"""

import tilelang.language as T

from ..constants import KV_LORA_RANK, ROPE_DIM
from .common import (LOG2E, make_store_rows, num_row_blocks, pipelined, request_inputs, segment_span, split_dims,
                     split_prim_func, wait_for_inputs)
from .configs import KernelConfig

FP8_LOAD_WIDTH = 4  # fp8 elements a thread loads and converts per step (load_block_fp8)


def build_decode_kernel(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                        cfg: KernelConfig):
    """Returns the split-KV prim_func (``common.split_prim_func``: its name and arguments)."""
    block_rows, block_n = cfg.block_rows, cfg.block_n
    rows = num_heads * q_len
    n_row_blocks = num_row_blocks(num_heads, q_len, block_rows)
    accum = "float32"
    is_fp8 = kv_dtype != dtype

    dims = split_dims()
    batch, num_parts = dims.batch, dims.num_parts
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
    def load_block_fp8(kv_cache, page_table, pt0, pos0, kv_len, kv_dst, pe_dst):
        """load_block for an fp8 cache: each element is converted to ``dtype`` on its way to shared memory (e4m3 ->
        fp16/bf16 is exact; the per-tensor scale is applied to S and O instead, also exact).

        Four elements per thread and step: TileLang's HIP codegen converts a 4-wide fp8 vector element by element
        (``fp8_e4_4_t``'s fields) but has no element access for the 8-wide one the 16-bit tiles would otherwise
        get (``PrintVecElemLoad``: ``Check failed: (!type_name.empty())``).
        """
        for j, d in T.Parallel(block_n, KV_LORA_RANK, coalesced_width=T.int32(FP8_LOAD_WIDTH)):
            kv_dst[j, d] = T.cast(kv_cache[page_table[pt0 + T.min(pos0 + j, kv_len - 1) // page_size],
                                           T.min(pos0 + j, kv_len - 1) % page_size, d], dtype)
        for j, d in T.Parallel(block_n, ROPE_DIM, coalesced_width=T.int32(FP8_LOAD_WIDTH)):
            pe_dst[j, d] = T.cast(kv_cache[page_table[pt0 + T.min(pos0 + j, kv_len - 1) // page_size],
                                           T.min(pos0 + j, kv_len - 1) % page_size, KV_LORA_RANK + d], dtype)

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

    @T.macro
    def split_program(q_nope, q_pe, kv_cache, k_scale, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                      part_begin_req, part_end_req, part_start, req_parts, sm_scale, out, lse, out_partial, lse_partial):
        """The grid (part, row block); the combine merges every split request."""
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
            # the tiles a KV block is loaded into (an fp8 cache converted on the way)
            kv_stage, pe_stage = kv_shared, k_pe_shared

            wait_for_inputs(cfg.pdl)
            # S = q . (k_scale * k8) = k_scale * (q . k8) and O = k_scale * (P @ v8): fold the fp8 scale
            # into the softmax scale and the output (k_scale is 1 for fp16/bf16 caches).
            kv_scale = k_scale[0]
            scale_log2 = sm_scale[0] * kv_scale * LOG2E
            part_lo = part_start[part]
            part_hi = part_start[part + 1]
            row0 = row_block * block_rows

            for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                req_lo, req_hi, blk_lo, blk_hi = segment_span(cu_blocks, req, part_lo, part_hi)
                if blk_hi > blk_lo:
                    kv_len, tok0, pt0 = request_inputs(kv_lens, qo_indptr, page_table_start, req)
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
                        if is_fp8:
                            load_block_fp8(kv_cache, page_table, pt0, pos0, kv_len, kv_stage, pe_stage)
                        else:
                            load_block(kv_cache, page_table, pt0, pos0, kv_len, kv_stage, pe_stage)
                        attend_block(q_shared, q_pe_shared, kv_shared, k_pe_shared, p_shared, acc_s, acc_o, m_prev, m_cur,
                                     alpha, row_sum, l_sum, pos0, vis0, row0, scale_log2)

                    # direct write when the whole request lies in this part, else partial slot part + req
                    store_rows(acc_o, l_sum, m_cur, kv_scale, req_parts[2 * req + 1] == 1, part + req,
                               tok0, row0, out, lse, out_partial, lse_partial)

    return split_prim_func(num_heads, q_len, page_size, dtype, kv_dtype, dims, split_program)
