"""The Hopper decode's schedule: one variant's choices (``variant_spec``) and the split kernel's prim_func.

One program per (part, 64-row block): WG0 and WG1 consume (consumers.py, epilogue.py), one or two producer
warpgroups fill Q and the KV buffers (producer.py), synchronised by the mbarriers of protocol.py. Where heads x q_len
<= 16 (``transposed``, "tws") the consumers compute S^T = K Q^T with the 64 KV tokens as WGMMA's M; otherwise ("ws")
S = Q K^T over 64-row blocks.
"""

from types import SimpleNamespace

import tilelang.language as T

from ...constants import ROPE_DIM
from ..common import LOG2E, make_store_rows, num_row_blocks, split_dims, split_prim_func, wait_for_inputs
from ..configs import SM90, KernelConfig, fp8_compute_applies, kernel_launch
from .consumers import consumer_macros
from .epilogue import epilogue_macros, make_store_cols
from .fp8c import fp8c_prelude, fp8c_program
from .producer import producer_macros
from .roles import wg0_roles, wg1_roles
from .protocol import (HALF, N_PARTS, PART_L, PART_T, PRELUDE, Q_F16_SHIFT, TWS_COLS, TWS_TILE, grows, kernel_threads,
                       kv_buffer, part_barrier, register_budget, trace_prelude)


def alloc_row_tiles(n_rows: int, dtype: str):
    """Shared tiles ``(left [n_rows, 256], right [n_rows, 256], rope [n_rows, 64])`` of ``n_rows`` 576-dim rows (Q, or
    one KV buffer), the layout of both operands of S: WG0 and WG1 each multiply P by their own 256-dim half of V, and a
    KV buffer is filled (and with tile_ready waited for) tile by tile."""
    return (T.alloc_shared([n_rows, HALF], dtype), T.alloc_shared([n_rows, HALF], dtype),
            T.alloc_shared([n_rows, ROPE_DIM], dtype))


def variant_spec(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str, cfg: KernelConfig = SM90):
    """The shapes, dtypes, roles and schedule choices of one kernel variant (a namespace the role modules' macro
    factories read), from which ``build_decode_kernel`` builds its prim_func."""
    block_rows, block_n = cfg.block_rows, cfg.block_n
    if (block_rows, block_n, cfg.threads) != (64, 64, 384):
        raise ValueError(f"the Hopper kernel is written for 64 rows x 64 tokens x 384 threads, got {cfg}")
    is_fp8 = kv_dtype != dtype

    rows = num_heads * q_len
    # tws: transposed consumers where the rows fit one m64n16 tile (one row block); the ws kernel otherwise
    transposed = rows <= TWS_COLS
    # fp8 compute (fp8c.py): the ws kernel with an fp8 cache, S and P V on e4m3 WGMMA
    fp8c = cfg.fp8_compute and fp8_compute_applies("sm90", num_heads, q_len, is_fp8)
    q_rows = TWS_COLS if transposed else block_rows  # rows of the Q and P tiles
    s_regs = block_n * q_rows // 128  # fp32 registers of S per consumer thread (128 per warpgroup)
    n_row_blocks = num_row_blocks(num_heads, q_len, block_rows)
    pad_rows = n_row_blocks * q_rows != rows  # the last row block has rows that are never stored
    accum = "float32"
    # each consumer warpgroup stores its 256 output columns; WG0 also owns the LSE
    store_left = make_store_rows(num_heads, q_len, block_rows, HALF)
    store_right = make_store_rows(num_heads, q_len, block_rows, HALF, col0=HALF, with_lse=False)
    store_left_t = make_store_cols(num_heads, q_len, HALF)
    store_right_t = [make_store_cols(num_heads, q_len, TWS_TILE, col0=HALF + k * TWS_TILE, with_lse=False)
                     for k in range(HALF // TWS_TILE)]
    # producer thread t copies 16-byte chunks: row (r * 16 + t // 8) of a 64-row tile, chunk t % 8 (+ 8 u)
    vec = 8  # dtype elements per 16-byte cp.async
    # fp8 cache, ws: the producer keeps one row's loads in flight while it converts the other (next block's row 0
    # during this block's row 1); tws: TWS_FP8_PRODUCERS producer warpgroups, block g converted by producer
    # g % n_producers from its raw registers
    threads = kernel_threads(is_fp8, transposed)
    n_producers = threads // 128 - 2
    rr_fp8 = n_producers > 1
    fp8_rows = 2  # KV rows of raw bytes a producer thread holds (fp8)
    # ws with an fp8 cache computes in fp16 (shared tiles, P): e4m3 -> fp16 is one instruction per pair
    # (bf16 takes five), exact, and fp16 holds P and the e4m3 values with more precision than bf16. A bf16
    # q is converted in shared memory, times 2^-Q_F16_SHIFT (undone in the softmax scale). fp8c: Q, K and P in e4m3.
    cdtype = "float8_e4m3" if fp8c else "float16" if is_fp8 else dtype
    q_to_f16 = cdtype == "float16" and dtype != "float16"
    convert = "mla_e4m3x16_store<true>" if cdtype == "bfloat16" else "mla_e4m3x16_store<false>"
    regs_wg0, regs_wg1, regs_producer = register_budget(is_fp8, transposed, fp8c)
    # 16-bit cache, blocks never straddle pages: a whole block is nine TMA boxes of 64 tokens x 64 dims (one
    # thread issues them; the tensor map views the cache as [num_pages, page_size, 576]). A request's last,
    # partial block keeps the cp.async gather, which re-reads its last row instead of stale slots.
    tma_kv = not is_fp8 and page_size % block_n == 0
    # ws WG0 multiplies its half of P V from P in registers (as FlashAttention-3's first consumer does for
    # head_dim_v 512): no WGMMA of WG0 reads P's shared tile (WG1's copy), so WG0 stores P and alpha without a
    # barrier of its own and issues its GEMM before handing P to WG1; alpha goes to a slot per block parity, so
    # it is stored before WG0 waits for WG1 to be done with the previous P. roles.wg0_ws has the rest of its order.
    rs_pv = not transposed
    # ws, 16-bit cache: each tile of a KV buffer (left, right, rope) lands on its own k_ready, so WG0's S starts on
    # the left tile while the rest is in flight and WG1 waits for its V half only; the buffer is freed as one
    tile_ready = not transposed and not is_fp8
    # cluster_kv: the CTAs of row blocks 2i and 2i + 1 of a part (one cluster) walk the same blocks; of a whole block,
    # rank 0 issues the left tile and rank 1 the right tile, each multicast to both (the rope tile: below); a buffer
    # is refilled once the consumers of both CTAs have released it (k_free counts both CTAs' arrivals)
    cluster = tma_kv and tile_ready and n_row_blocks % 2 == 0
    # cluster_kv: the rope box multicast too, by rank g % 2 (else each CTA loads its own)
    cluster_rope = cluster

    def box_issuer(part, g):
        """The rank of a cluster_kv pair that issues tile ``part`` of block g for both CTAs."""
        return g % 2 if part == PART_T else (0 if part == PART_L else 1)

    tracing = cfg.trace_part >= 0

    @T.macro
    def trace(role, g, step):
        """KernelConfig.trace_part: this role's clock at ``step`` of block g (nothing otherwise)."""
        if tracing:
            T.evaluate(T.call_extern("handle", "mla_trace", role, g, step))

    @T.macro
    def trace_end(role):
        if tracing:
            T.evaluate(T.call_extern("handle", "mla_trace_end", role))

    def last_copy_barrier(g):
        """The k_ready barrier of block g's last copy."""
        return part_barrier(g, PART_T) if tile_ready else kv_buffer(g)

    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "cfg"}, cfg=cfg)


def build_decode_kernel(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                        cfg: KernelConfig = SM90):
    """Returns the split-KV prim_func of the Hopper decode (sm_90a): ``common.split_prim_func``'s name and arguments,
    as the portable kernel's."""
    k = variant_spec(num_heads, q_len, page_size, dtype, kv_dtype, cfg)
    accum, block_n, block_rows, cdtype = k.accum, k.block_n, k.block_rows, k.cdtype
    cfg, cluster, fp8_rows = k.cfg, k.cluster, k.fp8_rows
    is_fp8, kv_dtype, n_producers, n_row_blocks = k.is_fp8, k.kv_dtype, k.n_producers, k.n_row_blocks
    q_rows, q_to_f16, regs_producer = k.q_rows, k.q_to_f16, k.regs_producer
    rs_pv, threads, tile_ready, tracing = k.rs_pv, k.threads, k.tile_ready, k.tracing
    transposed = k.transposed

    dims = split_dims()
    batch, num_parts, num_slots = dims.batch, dims.num_parts, dims.num_slots
    p, c, e = producer_macros(k), consumer_macros(k), epilogue_macros(k)
    prelude = PRELUDE + (trace_prelude(cfg.trace_part) if tracing else "")
    if k.fp8c:
        program = fp8c_program(k, c, e, num_parts, batch, prelude + fp8c_prelude())
        return split_prim_func(num_heads, q_len, page_size, dtype, kv_dtype, dims, program)
    (wg0_tws, wg0_ws), (wg1_tws, wg1_ws, producer) = wg0_roles(k, c, e, p), wg1_roles(k, c, e, p)

    @T.macro
    def split_program(q_nope, q_pe, kv_cache, k_scale, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                      part_begin_req, part_end_req, part_start, req_parts, sm_scale, out, lse, out_partial, lse_partial):
        """The grid (part, row block; a cluster of two row blocks with cluster_kv), one role per warpgroup."""
        with kernel_launch(num_parts, n_row_blocks, threads=threads, prelude=prelude,
                           cluster_dims=(1, 2, 1) if cluster else None) as (part, row_block):
            q_l, q_r, q_t = alloc_row_tiles(q_rows, cdtype)
            kv0_l, kv0_r, k0_t = alloc_row_tiles(block_n, cdtype)  # the two KV buffers
            kv1_l, kv1_r, k1_t = alloc_row_tiles(block_n, cdtype)
            p_shared = T.alloc_shared([q_rows, block_n], cdtype)
            colmax_s = T.alloc_shared([128], accum)  # tws WG0: the column-max exchange, 2 x 64
            alpha_shared = T.alloc_shared([q_rows], accum)
            alpha_slots = T.alloc_shared([2 * block_rows], accum) if rs_pv else None  # rs_pv: alpha, by alpha_slot
            p_frag = T.alloc_fragment([block_rows, block_n], cdtype) if rs_pv else None
            l_shared = T.alloc_shared([q_rows], accum)  # l of WG0's rows for WG1

            # S (rows x tokens) and O (rows x dims); tws: S^T and O^T
            acc_s = T.alloc_fragment([block_n, q_rows] if transposed else [block_rows, block_n], accum)
            acc_o_l = T.alloc_fragment([HALF, q_rows] if transposed else [block_rows, HALF], accum)
            if transposed:
                l_acc = T.alloc_fragment([block_n, q_rows], accum)  # WG0: per-thread partial column sums of P
                # WG1's O^T as four 64-dim tiles: TileLang 0.1.9 gives a [256, 16] accumulator of the second
                # warpgroup a thread-dependent register index (nvcc puts it in local memory); 64 rows do not
                acc_o_r0 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r1 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r2 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r3 = T.alloc_fragment([TWS_TILE, q_rows], accum)
            else:
                acc_o_r = T.alloc_fragment([block_rows, HALF], accum)
            m_prev = T.alloc_fragment([q_rows], accum)
            m_cur = T.alloc_fragment([q_rows], accum)
            alpha = T.alloc_fragment([q_rows], accum)
            if not transposed:  # tws keeps per-thread sums (l_acc) instead
                row_sum = T.alloc_fragment([q_rows], accum)
            l_sum = T.alloc_fragment([q_rows], accum)
            l_r = T.alloc_fragment([q_rows], accum)
            alpha_r = T.alloc_fragment([q_rows], accum)
            raw = T.alloc_local([9 * fp8_rows, 16], kv_dtype)  # producer, fp8 cache only: 9 chunks per row
            # producer: the pages of its rows of a block (fp8: 2 rows of the next block; 16-bit: 4 rows)
            pages = T.alloc_local([2 if is_fp8 else block_n // 16], "int32")
            if tile_ready:  # k_ready per tile (part_barrier), k_free per buffer
                k_ready = T.alloc_barrier([128] * (2 * N_PARTS))
                k_free = (T.alloc_cluster_barrier([256 + 8, 256 + 8]) if cluster  # + one per warp of the pair's consumers
                          else T.alloc_barrier([256, 256]))
            else:
                k_ready = T.alloc_barrier([128, 128])
                k_free = T.alloc_barrier([256, 256])
            q_ready = T.alloc_barrier(128)
            q_free = T.alloc_barrier(128)  # WG0 alone reads Q
            p_ready = T.alloc_barrier(128)
            p_free = T.alloc_barrier(128)
            l_ready = T.alloc_barrier(128)
            l_free = T.alloc_barrier(128)

            seg = T.alloc_var("int32")  # non-empty request segments started by this program (per thread)

            tx = T.get_thread_binding()
            wait_for_inputs(cfg.pdl)
            if tracing:
                T.evaluate(T.call_extern("handle", "mla_trace_begin",
                                         T.access_ptr(out_partial[num_slots - 1, 0, 0], "w")))
            row0 = row_block * block_rows
            part_lo = part_start[part]
            part_hi = part_start[part + 1]
            kv_scale = k_scale[0]
            scale_log2 = sm_scale[0] * kv_scale * LOG2E * (2.0 ** Q_F16_SHIFT if q_to_f16 else 1.0)

            seg = 0
            if tx < 128:
                if transposed:
                    wg0_tws(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial,
                        lse_partial, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, p_shared, colmax_s,
                        alpha_shared, l_shared, acc_s, acc_o_l, l_acc, m_prev, m_cur, alpha, l_sum, k_ready, k_free,
                        q_ready, q_free, p_ready, p_free, l_ready, l_free, seg, tx, row0, req_parts, part_lo, part_hi,
                        kv_scale, scale_log2, part)
                else:
                    wg0_ws(kv_lens, qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial,
                        lse_partial, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, p_shared, alpha_shared,
                        alpha_slots, p_frag, l_shared, acc_s, acc_o_l, m_prev, m_cur, alpha, row_sum, l_sum, k_ready,
                        k_free, q_ready, q_free, p_ready, p_free, l_ready, l_free, seg, tx, row0, req_parts, part_lo,
                        part_hi, kv_scale, scale_log2, part)
            elif tx < 256:
                if transposed:
                    wg1_tws(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                        kv0_r, kv1_r, p_shared, alpha_shared, l_shared, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3, l_r,
                        alpha_r, k_ready, k_free, p_ready, p_free, l_ready, l_free, seg, row0, req_parts, part_lo,
                        part_hi, kv_scale, part)
                else:
                    wg1_ws(qo_indptr, cu_blocks, part_begin_req, part_end_req, out, lse, out_partial, lse_partial,
                        kv0_r, kv1_r, p_shared, alpha_shared, alpha_slots, l_shared, acc_o_r, l_r, alpha_r, k_ready,
                        k_free, p_ready, p_free, l_ready, l_free, seg, tx, row0, req_parts, part_lo, part_hi, kv_scale,
                        part)
            else:
                T.set_max_nreg(regs_producer, grows(regs_producer, threads))
                t = tx - 256 if n_producers == 1 else (tx - 256) % 128
                pw = (tx - 256) // 128  # producer warpgroup (rr_fp8: it converts the blocks g with g % n == pw)
                producer(q_nope, q_pe, kv_cache, page_table, page_table_start, kv_lens, qo_indptr, cu_blocks,
                    part_begin_req, part_end_req, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, raw, pages,
                    k_ready, k_free, q_ready, q_free, seg, t, pw, row0, part_lo, part_hi, part)
            if cluster:  # no CTA exits while its pair may still copy into it or arrive on its k_free
                T.cluster_sync()

    return split_prim_func(num_heads, q_len, page_size, dtype, kv_dtype, dims, split_program)
