"""The producer warpgroup(s) of the Hopper decode: Q and the KV blocks into shared memory.

A 16-bit cache: each block's page ids, then (once both consumers have released the buffer) the block by TMA where it
lies in one page (the CTAs of a cluster pair multicast it), else by a cp.async gather. An fp8 cache: plain loads into
registers and a conversion to fp16 in shared memory (the ws kernel: stream_segment, one row's loads in flight while
the other converts; the tws kernel: two producer warpgroups taking blocks in turn, rr_segment).
"""

from types import SimpleNamespace

import tilelang.language as T

from ...constants import HEAD_DIM, KV_LORA_RANK
from .protocol import (FP8_PREFETCH_AHEAD, HALF, PART_L, PART_R, PART_T, kv_buffer, kv_free_parity, part_barrier,
                       seg_free_parity)


def fp8_macros(k):
    """An fp8 cache's loads into registers, their conversion into the shared tiles, and L2 prefetches."""
    (block_n, convert, page_size) = (k.block_n, k.convert, k.page_size)

    @T.macro
    def store_converted(raw, chunk, dst, j, c):
        """16 e4m3 values of ``raw[chunk]`` -> ``dst[j, c .. c + 15]`` in ``cdtype``, as two 16-byte stores
        (the shared tiles are swizzled in 16-byte units)."""
        # Plain addresses, so TileLang's thread-sync pass sees no producer write to shared memory. Each thread
        # writes only its own bytes and no producer thread reads them (the consumers wait on k_ready), yet for the
        # access_ptr form TileLang 0.1.9 puts named barriers among the producer warps, a different number from one
        # compile of the same kernel to the next (tws: 0..8 per block; ws: 0 or 20).
        lo, hi = T.address_of(dst[j, c]), T.address_of(dst[j, c + 8])
        T.evaluate(T.call_extern("handle", convert, T.access_ptr(raw[chunk, 0], "r", 16), lo, hi))

    def fp8_row(pos0, r, t, kv_len):
        """Position of the fp8 producer thread t's row r (t // 4 + 32 r) of the block at pos0, tail clamped."""
        return T.min(pos0 + r * 32 + t // 4, kv_len - 1)

    @T.macro
    def fp8_pages(page_table, pt0, pos0, kv_len, pages, t):
        """pages[r]: the page holding row t // 4 + 32 r of the block at pos0 (tail rows clamped)."""
        for r in T.unroll(2):
            pages[r] = page_table[pt0 + fp8_row(pos0, r, t, kv_len) // page_size]

    @T.macro
    def fp8_issue_row(kv_cache, page, pos0, kv_len, raw, slot, r, t):
        """Loads (no wait) this thread's 9 chunks of row t // 4 + 32 r of the block at pos0 into raw slot
        ``slot``: chunks t % 4 + 4 k, k = 0..8 (512 latent dims, then 64 rope dims); 4 threads per row."""
        p = fp8_row(pos0, r, t, kv_len)
        for k in T.unroll(9):
            T.evaluate(T.call_extern("handle", "mla_ldg16", T.access_ptr(raw[slot * 9 + k, 0], "w", 16),
                                     T.access_ptr(kv_cache[page, p % page_size, k * 64 + (t % 4) * 16], "r", 16)))

    @T.macro
    def fp8_convert_row(raw, slot, r, kv_l, kv_r, k_t, t, first=0):
        """raw slot ``slot`` (row t // 4 + 32 r) -> ``cdtype`` in the shared tiles (exact); ``first``: chunks
        before it are already stored (0 or 1)."""
        j = r * 32 + t // 4
        for k in T.unroll(4 - first):
            store_converted(raw, slot * 9 + first + k, kv_l, j, (first + k) * 64 + (t % 4) * 16)
        for k in T.unroll(4):
            store_converted(raw, slot * 9 + 4 + k, kv_r, j, k * 64 + (t % 4) * 16)
        store_converted(raw, slot * 9 + 8, k_t, j, (t % 4) * 16)

    @T.macro
    def fp8_block(kv_cache, pages, pos0, kv_len, has_next, raw, kv_l, kv_r, k_t, t):
        """Second half of the ws producer's fp8 pipeline for one block (its buffer is free): row 0 is in
        flight since the previous block, row 1 since just before the k_free wait. Converting row 0 frees
        its registers for the next block's row 0, whose loads then overlap the conversion of row 1."""
        fp8_convert_row(raw, 0, 0, kv_l, kv_r, k_t, t)
        if has_next:
            fp8_issue_row(kv_cache, pages[0], pos0 + block_n, kv_len, raw, 0, 0, t)
        fp8_convert_row(raw, 1, 1, kv_l, kv_r, k_t, t)

    @T.macro
    def fp8_issue_rows(kv_cache, pages, pos0, kv_len, raw, slot0, t):
        """Loads (no wait) both of this thread's rows of the block at pos0 into raw slots slot0, slot0 + 1
        (``slot0`` a constant, so raw stays in registers); ``pages`` holds their pages."""
        for r in T.unroll(2):
            fp8_issue_row(kv_cache, pages[r], pos0, kv_len, raw, slot0 + r, r, t)

    @T.macro
    def prefetch_block(kv_cache, page_table, pt0, pos0, kv_len, t):
        """Asks L2 for the fp8 cache rows pos0 .. pos0 + 63 of one request: thread t takes half t % 2 of
        row t // 2 (288 bytes, at most 4 lines: bytes 0, 128, 256 and 287 of the half). Per-thread line
        prefetches: the bulk form takes a warp-uniform address and would loop over the warp's rows."""
        p = pos0 + t // 2
        if p < kv_len:
            page = page_table[pt0 + p // page_size]
            for u in T.unroll(4):
                T.evaluate(T.call_extern("handle", "mla_l2_prefetch", T.access_ptr(
                    kv_cache[page, p % page_size, (t % 2) * (HEAD_DIM // 2) + T.min(u * 128, HEAD_DIM // 2 - 1)],
                    "r", 1)))

    return SimpleNamespace(store_converted=store_converted, fp8_row=fp8_row, fp8_pages=fp8_pages,
        fp8_issue_row=fp8_issue_row, fp8_convert_row=fp8_convert_row, fp8_block=fp8_block,
        fp8_issue_rows=fp8_issue_rows, prefetch_block=prefetch_block)


def kv_macros(k):
    """Q and a 16-bit cache's KV blocks into shared memory: cp.async gathers, TMA (multicast in a cluster pair)."""
    (block_n, box_issuer, cluster, cluster_rope, num_heads, page_size, q_rows, rows, tma_kv, vec) = (k.block_n,
        k.box_issuer, k.cluster, k.cluster_rope, k.num_heads, k.page_size, k.q_rows, k.rows, k.tma_kv, k.vec)

    @T.macro
    def load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t):
        """cp.async of the segment's valid Q rows (rows past ``rows`` keep the zeros written at start)."""
        for r in T.serial(q_rows // 16):
            i = r * 16 + t // 8
            if row0 + i < rows:
                for u in T.serial(HALF // (8 * vec)):
                    c = u * 8 * vec + (t % 8) * vec
                    T.ptx_cp_async(
                        T.access_ptr(q_l[i, c], "w", vec),
                        T.access_ptr(q_nope[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, c], "r", vec),
                        vec)
                    T.ptx_cp_async(
                        T.access_ptr(q_r[i, c], "w", vec),
                        T.access_ptr(q_nope[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, HALF + c], "r", vec),
                        vec)
                T.ptx_cp_async(
                    T.access_ptr(q_t[i, (t % 8) * vec], "w", vec),
                    T.access_ptr(q_pe[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, (t % 8) * vec], "r", vec),
                    vec)

    @T.macro
    def kv_pages(page_table, pt0, pos0, kv_len, pages, t):
        """pages[r]: the page of row r * 16 + t // 8 of the block at pos0, tail rows clamped (16-bit cache)."""
        for r in T.unroll(block_n // 16):
            pages[r] = page_table[pt0 + T.min(pos0 + r * 16 + t // 8, kv_len - 1) // page_size]

    @T.macro
    def load_kv(kv_cache, pages, pos0, kv_len, kv_l, kv_r, k_t, t):
        """Gathers KV rows pos0 .. pos0 + 63 of one request into one buffer (3 tiles: 256 | 256 | 64 dims), from the
        pages ``kv_pages`` read.

        Rows past kv_len re-read row kv_len - 1 (their probabilities are 0): no page outside the
        request is touched and no stale (possibly NaN) cache slot can reach P @ V.
        """
        for r in T.serial(block_n // 16):
            j = r * 16 + t // 8
            p = T.min(pos0 + j, kv_len - 1)
            page = pages[r]
            slot = p % page_size
            for u in T.serial(HALF // (8 * vec)):
                c = u * 8 * vec + (t % 8) * vec
                T.ptx_cp_async(T.access_ptr(kv_l[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, slot, c], "r", vec), vec)
                T.ptx_cp_async(T.access_ptr(kv_r[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, slot, HALF + c], "r", vec), vec)
            T.ptx_cp_async(T.access_ptr(k_t[j, (t % 8) * vec], "w", vec),
                           T.access_ptr(kv_cache[page, slot, KV_LORA_RANK + (t % 8) * vec], "r", vec), vec)

    @T.macro
    def load_kv_tma(kv_cache, page, pos0, kv_l, kv_r, k_t, k_ready, buf):
        """load_kv of a whole block (pos0 + 64 <= kv_len, all in ``page``) by TMA, completing on ``k_ready[buf]``
        (one thread's expect_tx)."""
        slot0 = pos0 % page_size
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, 0:HALF], kv_l, barrier=k_ready[buf])
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, HALF:KV_LORA_RANK], kv_r, barrier=k_ready[buf])
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, KV_LORA_RANK:HEAD_DIM], k_t, barrier=k_ready[buf])

    @T.macro
    def load_part(kv_cache, pages, pos0, kv_len, dst, col0, t):
        """load_kv for one tile of a buffer: cache dims col0 .. col0 + width of rows pos0 .. pos0 + 63 into
        ``dst`` [64, width] (width 256 or 64; 8 lanes per row, 16 rows per pass), from the pages ``kv_pages`` read."""
        for r in T.serial(block_n // 16):
            j = r * 16 + t // 8
            p = T.min(pos0 + j, kv_len - 1)
            page = pages[r]
            for u in T.serial(dst.shape[1] // (8 * vec)):
                c = u * 8 * vec + (t % 8) * vec
                T.ptx_cp_async(T.access_ptr(dst[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, p % page_size, col0 + c], "r", vec), vec)

    @T.macro
    def fill_part(kv_cache, pages, pos0, kv_len, dst, col0, g, part, k_ready, k_free, t):
        """Tile ``part`` of block g's buffer, signalled on its own ``k_ready`` (the caller waited for the whole
        buffer); a whole block's tile by TMA (expect_tx by one thread), a partial block's by the cp.async gather."""
        if tma_kv and pos0 + block_n <= kv_len:
            slot0 = pos0 % page_size
            if cluster and (part != PART_T or cluster_rope):
                if t == 0:  # both CTAs expect the tile; one of them issues each box for both
                    T.mbarrier_expect_tx(k_ready[part_barrier(g, part)], block_n * dst.shape[1] * 2)
                    if T.block_rank_in_cluster() == box_issuer(part, g):
                        for c in T.unroll(dst.shape[1] // 64):
                            # Access mask 0: TMA writes the box (async proxy, completing on k_ready), not this
                            # thread. With "w", TileLang 0.1.15's thread-sync pass plans a barrier inside this
                            # one-thread branch and cannot lower it; 0.1.9 generates the same CUDA either way.
                            T.evaluate(T.call_extern("handle", "MLA_TMA_MC", k_ready[part_barrier(g, part)],
                                                     T.access_ptr(dst[0, c * 64], 0, 1), col0 + c * 64, slot0,
                                                     pages[0], 3))
            else:
                T.tma_copy(kv_cache[pages[0], slot0:slot0 + block_n, col0:col0 + dst.shape[1]],
                           dst, barrier=k_ready[part_barrier(g, part)])
            T.barrier_arrive(k_ready[part_barrier(g, part)])
        else:
            load_part(kv_cache, pages, pos0, kv_len, dst, col0, t)
            T.cp_async_barrier_noinc(k_ready[part_barrier(g, part)])

    @T.macro
    def release_kv(k_free, g, tx):
        """A consumer thread is done reading block g's buffer; cluster: its warp (once all of its lanes are, lane 0
        for them) also tells the other CTA of the pair, whose producer refills both CTAs' buffers."""
        T.barrier_arrive(k_free[kv_buffer(g)])
        if cluster:
            if tx % 32 == 0:
                T.mbarrier_arrive(k_free[kv_buffer(g)], 1 - T.block_rank_in_cluster())

    @T.macro
    def load_parts(kv_cache, pages, pos0, kv_len, kv_l, kv_r, k_t, g, k_ready, k_free, t):
        """Block g (tile_ready), tile by tile, each signalled on its own ``k_ready`` in the order S reads them (left,
        right, rope), after the caller waited for the whole buffer."""
        fill_part(kv_cache, pages, pos0, kv_len, kv_l, 0, g, PART_L, k_ready, k_free, t)
        fill_part(kv_cache, pages, pos0, kv_len, kv_r, HALF, g, PART_R, k_ready, k_free, t)
        fill_part(kv_cache, pages, pos0, kv_len, k_t, KV_LORA_RANK, g, PART_T, k_ready, k_free, t)

    return SimpleNamespace(load_q=load_q, kv_pages=kv_pages, load_kv=load_kv, load_kv_tma=load_kv_tma,
        load_part=load_part, fill_part=fill_part, release_kv=release_kv, load_parts=load_parts)


def producer_macros(k):
    """The producer's request segments for variant ``k`` (kernel.variant_spec), and ``release_kv`` for the consumers."""
    (block_n, is_fp8, n_producers, tile_ready, tma_kv, trace) = (k.block_n, k.is_fp8, k.n_producers, k.tile_ready,
        k.tma_kv, k.trace)
    f, v = fp8_macros(k), kv_macros(k)
    fp8_pages, fp8_issue_row, fp8_convert_row, fp8_block, fp8_issue_rows, prefetch_block = (
        f.fp8_pages, f.fp8_issue_row, f.fp8_convert_row, f.fp8_block, f.fp8_issue_rows, f.prefetch_block)
    load_q, kv_pages, load_kv, load_kv_tma, load_parts = v.load_q, v.kv_pages, v.load_kv, v.load_kv_tma, v.load_parts

    @T.macro
    def stream_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg, pw,
                       pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, q_free, q_ready, k_free,
                       k_ready, t):
        """The producer warpgroup, one request segment (blocks blk_lo .. blk_hi - 1 of the request, g0 the first's
        g): Q, then every block, through TMA or cp.async, or (ws) an fp8 cache's loads and conversions."""
        # Q of segment seg: WG0 has finished reading Q of segment seg - 1
        # the segment's first blocks (ws: later ones are asked for FP8_PREFETCH_AHEAD ahead)
        if is_fp8:
            for a in T.serial(FP8_PREFETCH_AHEAD):
                if blk_lo + a < blk_hi:
                    prefetch_block(kv_cache, page_table, pt0, (blk_lo + a) * block_n, kv_len, t)
        if is_fp8:  # row 0 of the segment's first block (later ones: during the previous block)
            fp8_pages(page_table, pt0, blk_lo * block_n, kv_len, pages, t)
            fp8_issue_row(kv_cache, pages[0], blk_lo * block_n, kv_len, raw, 0, 0, t)
        T.barrier_wait(q_free[0], seg_free_parity(seg))
        load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t)
        T.cp_async_barrier_noinc(q_ready[0])
        for blk in T.serial(blk_hi - blk_lo):
            g = g0 + blk
            pos0 = (blk_lo + blk) * block_n
            if is_fp8 and blk_lo + blk + FP8_PREFETCH_AHEAD < blk_hi:
                prefetch_block(kv_cache, page_table, pt0, pos0 + FP8_PREFETCH_AHEAD * block_n, kv_len, t)
            if is_fp8:  # loads go to registers: issue them before the buffer is free
                fp8_issue_row(kv_cache, pages[1], pos0, kv_len, raw, 1, 1, t)
                if blk + 1 < blk_hi - blk_lo:
                    fp8_pages(page_table, pt0, pos0 + block_n, kv_len, pages, t)
            trace(2, g, 0)
            # 16-bit cache: the block's pages are read before the wait for its buffer, so that the page table's
            # latency overlaps the wait instead of delaying the copies
            if not is_fp8:
                kv_pages(page_table, pt0, pos0, kv_len, pages, t)
            # both consumers are done with the block that used this buffer before (g - 2)
            trace(2, g, 1)
            T.barrier_wait(k_free[kv_buffer(g)], kv_free_parity(g))
            trace(2, g, 2)
            if is_fp8:
                if kv_buffer(g) == 0:
                    fp8_block(kv_cache, pages, pos0, kv_len, blk + 1 < blk_hi - blk_lo, raw,
                              kv0_l, kv0_r, k0_t, t)
                else:
                    fp8_block(kv_cache, pages, pos0, kv_len, blk + 1 < blk_hi - blk_lo, raw,
                              kv1_l, kv1_r, k1_t, t)
            elif tile_ready:
                if kv_buffer(g) == 0:
                    load_parts(kv_cache, pages, pos0, kv_len, kv0_l, kv0_r, k0_t, g, k_ready, k_free, t)
                else:
                    load_parts(kv_cache, pages, pos0, kv_len, kv1_l, kv1_r, k1_t, g, k_ready, k_free, t)
            elif tma_kv and pos0 + block_n <= kv_len:
                if kv_buffer(g) == 0:
                    load_kv_tma(kv_cache, pages[0], pos0, kv0_l, kv0_r, k0_t, k_ready, 0)
                else:
                    load_kv_tma(kv_cache, pages[0], pos0, kv1_l, kv1_r, k1_t, k_ready, 1)
            elif kv_buffer(g) == 0:
                load_kv(kv_cache, pages, pos0, kv_len, kv0_l, kv0_r, k0_t, t)
            else:
                load_kv(kv_cache, pages, pos0, kv_len, kv1_l, kv1_r, k1_t, t)
            if is_fp8:
                T.fence_proxy_async()  # generic stores, read by WGMMA (async proxy)
                T.barrier_arrive(k_ready[kv_buffer(g)])
            elif not tile_ready:  # (tile_ready: each tile signalled its own k_ready in fill_part)
                if tma_kv and pos0 + block_n <= kv_len:  # the TMA bytes complete the phase, not the arrivals
                    T.barrier_arrive(k_ready[kv_buffer(g)])
                else:
                    T.cp_async_barrier_noinc(k_ready[kv_buffer(g)])
            trace(2, g, 3)

    @T.macro
    def rr_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg, pw,
                   pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, q_free, q_ready, k_free,
                   k_ready, t):
        """tws fp8, producer warpgroup ``pw`` of ``n_producers``, one request segment: its blocks are blk = first,
        first + n, ... (g = g0 + blk, g % n == pw). This thread's two rows of a block are converted from the raw
        registers, then the loads of the producer's next block are issued into them: no conversion of this thread
        waits for those loads before that block's turn, n blocks later. Producer 0 also loads the segment's Q."""
        n_blk = blk_hi - blk_lo
        first = (pw + n_producers - g0 % n_producers) % n_producers
        if first < n_blk:
            fp8_pages(page_table, pt0, (blk_lo + first) * block_n, kv_len, pages, t)
            fp8_issue_rows(kv_cache, pages, (blk_lo + first) * block_n, kv_len, raw, 0, t)
            if first + n_producers < n_blk:
                fp8_pages(page_table, pt0, (blk_lo + first + n_producers) * block_n, kv_len, pages, t)
        if pw == 0:
            T.barrier_wait(q_free[0], seg_free_parity(seg))
            load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t)
            T.cp_async_barrier_noinc(q_ready[0])
        for i in T.serial((n_blk - first + n_producers - 1) // n_producers):
            blk = first + i * n_producers
            g = g0 + blk
            pos0 = (blk_lo + blk) * block_n
            T.barrier_wait(k_free[kv_buffer(g)], kv_free_parity(g))
            if kv_buffer(g) == 0:
                fp8_convert_row(raw, 0, 0, kv0_l, kv0_r, k0_t, t)
                fp8_convert_row(raw, 1, 1, kv0_l, kv0_r, k0_t, t)
            else:
                fp8_convert_row(raw, 0, 0, kv1_l, kv1_r, k1_t, t)
                fp8_convert_row(raw, 1, 1, kv1_l, kv1_r, k1_t, t)
            T.fence_proxy_async()  # generic stores, read by WGMMA (async proxy)
            T.barrier_arrive(k_ready[kv_buffer(g)])
            if blk + n_producers < n_blk:
                fp8_issue_rows(kv_cache, pages, pos0 + n_producers * block_n, kv_len, raw, 0, t)
                if blk + 2 * n_producers < n_blk:
                    fp8_pages(page_table, pt0, pos0 + 2 * n_producers * block_n, kv_len, pages, t)

    return SimpleNamespace(stream_segment=stream_segment, rr_segment=rr_segment,
                           produce_segment=rr_segment if k.rr_fp8 else stream_segment, release_kv=v.release_kv)
