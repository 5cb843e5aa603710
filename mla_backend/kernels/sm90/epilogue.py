"""A request segment's end in the Hopper decode: O normalised, O and the LSE written to ``out`` / ``lse`` or, for a
request cut into parts, to the part's partial slot (the combine kernel merges them)."""

from types import SimpleNamespace

import tilelang.language as T

from ..common import LN2, SegmentStore, partial_lse, request_parts
from .protocol import TWS_COLS, seg_free_parity, seg_ready_parity


def make_store_cols(num_heads: int, q_len: int, ndims: int, col0: int = 0, with_lse: bool = True) -> SegmentStore:
    """tws segment epilogue: ``make_store_rows`` for a transposed accumulator ``acc [ndims, TWS_COLS]`` (dims
    ``col0 .. col0 + ndims`` of 512 x rows; one row block). Columns past ``num_heads * q_len`` are padding."""
    rows = num_heads * q_len
    accum = "float32"

    @T.macro
    def normalize(acc, l_sum, kv_scale, factor):
        for i in T.Parallel(TWS_COLS):
            factor[i] = T.if_then_else(l_sum[i] == 0, 0, kv_scale / l_sum[i])
        for d, i in T.Parallel(ndims, TWS_COLS):
            acc[d, i] *= factor[i]

    @T.macro
    def write(acc, l_sum, m_cur, direct, slot, tok0, row0, out, lse, out_partial, lse_partial):
        """As make_store_rows' write; ``row0`` is 0 (one row block), there for the same signature."""
        if direct:
            for d, i in T.Parallel(ndims, TWS_COLS):
                if i < rows:
                    out[tok0 + i // num_heads, i % num_heads, col0 + d] = acc[d, i]
            if with_lse:
                for i in T.Parallel(TWS_COLS):
                    if i < rows:
                        lse[tok0 + i // num_heads, i % num_heads] = T.if_then_else(
                            l_sum[i] == 0, -T.infinity(accum), (T.log2(l_sum[i]) + m_cur[i]) * LN2)
        else:
            for d, i in T.Parallel(ndims, TWS_COLS):
                if i < rows:
                    out_partial[slot, i, col0 + d] = acc[d, i]
            if with_lse:
                for i in T.Parallel(TWS_COLS):
                    if i < rows:
                        lse_partial[slot, i] = partial_lse(l_sum[i], m_cur[i])

    @T.macro
    def store(acc, l_sum, m_cur, kv_scale, direct, slot, tok0, out, lse, out_partial, lse_partial):
        for d, i in T.Parallel(ndims, TWS_COLS):
            acc[d, i] = T.if_then_else(l_sum[i] == 0, 0, acc[d, i] * kv_scale / l_sum[i])
        write(acc, l_sum, m_cur, direct, slot, tok0, 0, out, lse, out_partial, lse_partial)

    return SegmentStore(normalize, write, store)


def epilogue_macros(k):
    """The segment epilogues of variant ``k`` (kernel.variant_spec): normalise, write."""
    q_rows, store_left, store_left_t, store_right, transposed = (
        k.q_rows, k.store_left, k.store_left_t, k.store_right, k.transposed)

    def store_direct(req_parts, req):
        """A segment's store goes to out / lse: request ``req`` lies in one part (else to this part's partial slot,
        which the combine kernel merges)."""
        return request_parts(req_parts, req)[1] == 1

    def make_store_segment(store: SegmentStore):
        """A consumer's segment end after the l hand-off, for ``store``'s columns: normalise O, write (``factor`` is
        scratch)."""

        @T.macro
        def store_segment(acc, l, m, factor, kv_scale, req_parts, part, req, row0, tok0, out, lse, out_partial,
                          lse_partial):
            store.normalize(acc, l, kv_scale, factor)
            store.write(acc, l, m, store_direct(req_parts, req), part + req, tok0, row0, out, lse, out_partial,
                        lse_partial)

        return store_segment

    wg0_store_segment = make_store_segment(store_left_t if transposed else store_left)
    wg1_store_segment = make_store_segment(store_right)

    @T.macro
    def send_l(l_sum, l_shared, l_free, l_ready, seg: T.Ref):
        """WG0, segment ``seg``'s end: its row sums ``l_sum [q_rows]`` into ``l_shared`` for WG1, once WG1 has read
        the previous segment's."""
        T.barrier_wait(l_free[0], seg_free_parity(seg))
        for i in T.Parallel(q_rows):
            l_shared[i] = l_sum[i]
        T.barrier_arrive(l_ready[0])

    @T.macro
    def receive_l(l_r, l_shared, l_ready, l_free, seg: T.Ref):
        """WG1, segment ``seg``'s end: WG0's row sums from ``l_shared`` into ``l_r [q_rows]``, then ``l_shared``
        handed back."""
        T.barrier_wait(l_ready[0], seg_ready_parity(seg))
        for i in T.Parallel(q_rows):
            l_r[i] = l_shared[i]
        T.barrier_arrive(l_free[0])

    @T.macro
    def wg0_end_segment(acc_o_l, l_sum, m_cur, alpha, l_shared, l_free, l_ready, seg: T.Ref, kv_scale, req_parts, part,
                        req, row0, tok0, out, lse, out_partial, lse_partial):
        """WG0, the end of request ``req``'s segment in part ``part`` (its parts from ``req_parts``): l to WG1, then
        O[:, :256] and the LSE normalised and written (``alpha`` is free by now: the scratch)."""
        send_l(l_sum, l_shared, l_free, l_ready, seg)
        wg0_store_segment(acc_o_l, l_sum, m_cur, alpha, kv_scale, req_parts, part, req, row0, tok0, out, lse,
                          out_partial, lse_partial)

    return SimpleNamespace(store_direct=store_direct, make_store_segment=make_store_segment,
                           wg0_store_segment=wg0_store_segment, wg1_store_segment=wg1_store_segment, send_l=send_l,
                           receive_l=receive_l, wg0_end_segment=wg0_end_segment)
