"""A request segment's end in the Hopper decode: O normalised, a two-part request merged by the second of its
programs to finish (merge_pairs), O and the LSE written to ``out`` / ``lse`` or to the request's partial slot."""

from types import SimpleNamespace

import tilelang.language as T

from ..common import LN2, SegmentStore, partial_lse, request_parts
from .protocol import HALF, MERGE_DONE_SHIFT, TWS_COLS, TWS_TILE, seg_free_parity, seg_ready_parity


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
    """The segment epilogues of variant ``k`` (kernel.variant_spec): normalise, merge, write."""
    in_merge, n_row_blocks, q_rows, rows, store_left, store_left_t, store_right, transposed = (
        k.in_merge, k.n_row_blocks, k.q_rows, k.rows, k.store_left, k.store_left_t, k.store_right, k.transposed)

    @T.macro
    def merge_begin(merge_count, merge_ticket, req, row_block, first, part, n_parts, merge_state):
        """Both consumers, end of a segment of a request of ``n_parts``: with two parts take this program's
        ticket; the second one waits for the other part's partial (``merge_state[1] = 1``: this program merges).
        Only a part's first and last segments can be cut, so each has its own ticket slot (the request's first part:
        this part's last segment, slot 1), written once per program."""
        merge_state[1] = 0
        if n_parts == 2:
            ticket_slots, ticket_ready = merge_ticket
            merge_state[0] = T.call_extern("int32", "mla_merge_ticket", T.access_ptr(merge_count[0], "rw", 1),
                                           req * n_row_blocks + row_block, T.access_ptr(ticket_slots[0], "rw", 2),
                                           T.if_then_else(part == first, 1, 0), T.access_ptr(ticket_ready[0], "rw", 2))
            if merge_state[0] % (1 << MERGE_DONE_SHIFT) == 1:
                T.evaluate(T.call_extern("handle", "mla_merge_wait", T.access_ptr(merge_count[0], "rw", 1),
                                         req * n_row_blocks + row_block))
                merge_state[1] = 1

    @T.macro
    def merge_end(merge_count, req, row_block, n_parts, merge_state):
        """Both consumers, after the segment's stores: the first part of two to finish counts its partial."""
        if n_parts == 2 and merge_state[1] == 0:
            T.evaluate(T.call_extern("handle", "mla_merge_done", T.access_ptr(merge_count[0], "rw", 1),
                                     req * n_row_blocks + row_block))

    @T.macro
    def merge_weights(l, m, w_own, w_other, other, row0, lse_partial):
        """The merging program, per row: this part's and the other part's weights (w_own, w_other); m becomes the
        larger log2 LSE (the offset) and l the merged sum. The own LSE is ``partial_lse``, what the other part's
        program would have stored for this one."""
        for i in T.Parallel(q_rows):
            w_own[i] = partial_lse(l[i], m[i])
        T.evaluate(T.call_extern("handle", f"mla_merge2_weights<{'true' if transposed else 'false'}>", w_own.data,
                                 w_other.data, m.data, l.data, T.access_ptr(lse_partial[other, row0], "r"), rows - row0))

    def merge_add(acc, w_own, w_other, other, row0, col0, out_partial, tiles: int = 0):
        """acc = w_own acc + w_other (the other part's partial), for columns col0 .. of 512 (tws: ``tiles`` tiles)."""
        fn = f"mla_merge2_add_cols<{tiles}>" if transposed else "mla_merge2_add_rows"
        return T.evaluate(T.call_extern("handle", fn, acc.data, w_own.data, w_other.data,
                                        T.access_ptr(out_partial[other, row0, col0], "r"), rows - row0))

    def merge_other(first, part, req):
        """The partial slot of a two-part request's other part."""
        return T.if_then_else(part == first, first + 1, first) + req

    def store_direct(n_parts, merge_state):
        """A segment's store goes to out / lse: the request lies in this part, or this program merged it."""
        return T.Or(n_parts == 1, merge_state[1] == 1) if in_merge else n_parts == 1

    def make_store_segment(store: SegmentStore, col0: int, tiles: int = 0):
        """A consumer's segment end after the l (and m) hand-off, for ``store``'s columns ``col0 ..``: normalise O,
        merge a two-part request if this program finishes second, write. ``factor`` is scratch; ``w_own`` and
        ``w_other`` hold the merge weights (either may be ``factor``)."""

        @T.macro
        def store_segment(acc, l, m, w_own, w_other, factor, kv_scale, first, n_parts, part, req, row_block, row0, tok0,
                          merge_count, merge_ticket, merge_state, out, lse, out_partial, lse_partial):
            store.normalize(acc, l, kv_scale, factor)
            if in_merge:
                merge_begin(merge_count, merge_ticket, req, row_block, first, part, n_parts, merge_state)
                if merge_state[1] == 1:
                    other = merge_other(first, part, req)
                    merge_weights(l, m, w_own, w_other, other, row0, lse_partial)
                    merge_add(acc, w_own, w_other, other, row0, col0, out_partial, tiles)
                    store.normalize(acc, l, T.float32(1), factor)
            store.write(acc, l, m, store_direct(n_parts, merge_state), part + req, tok0, row0, out, lse, out_partial,
                        lse_partial)
            if in_merge:
                merge_end(merge_count, req, row_block, n_parts, merge_state)

        return store_segment

    wg0_store_segment = make_store_segment(store_left_t if transposed else store_left, 0, HALF // TWS_TILE)
    wg1_store_segment = make_store_segment(store_right, HALF)

    @T.macro
    def send_l(l_sum, m_cur, l_shared, l_free, l_ready, seg: T.Ref):
        """WG0, segment ``seg``'s end: its row sums ``l_sum [q_rows]`` (with in_merge also its row max ``m_cur``,
        after them) into ``l_shared`` for WG1, once WG1 has read the previous segment's."""
        T.barrier_wait(l_free[0], seg_free_parity(seg))
        for i in T.Parallel(q_rows):
            l_shared[i] = l_sum[i]
        if in_merge:
            for i in T.Parallel(q_rows):
                l_shared[q_rows + i] = m_cur[i]
        T.barrier_arrive(l_ready[0])

    @T.macro
    def receive_l(l_r, m_r, l_shared, l_ready, l_free, seg: T.Ref):
        """WG1, segment ``seg``'s end: WG0's row sums (with in_merge its row max) from ``l_shared`` into ``l_r``
        (``m_r``) ``[q_rows]``, then ``l_shared`` handed back."""
        T.barrier_wait(l_ready[0], seg_ready_parity(seg))
        for i in T.Parallel(q_rows):
            l_r[i] = l_shared[i]
        if in_merge:
            for i in T.Parallel(q_rows):
                m_r[i] = l_shared[q_rows + i]
        T.barrier_arrive(l_free[0])

    @T.macro
    def wg0_end_segment(acc_o_l, l_sum, m_cur, alpha, m_prev, l_shared, l_free, l_ready, seg: T.Ref, kv_scale,
                        req_parts, part, req, row_block, row0, tok0, merge_count, merge_ticket, merge_state, out, lse,
                        out_partial, lse_partial):
        """WG0, the end of request ``req``'s segment in part ``part`` (its parts from ``req_parts``): l and m to
        WG1, then O[:, :256] and the LSE normalised, merged if this program finishes a two-part request second, and
        written (``alpha`` and ``m_prev`` are free by now: the scratch and the merge weights)."""
        send_l(l_sum, m_cur, l_shared, l_free, l_ready, seg)
        first, n_parts = request_parts(req_parts, req)
        wg0_store_segment(acc_o_l, l_sum, m_cur, alpha, m_prev, m_prev, kv_scale, first, n_parts, part, req, row_block,
                          row0, tok0, merge_count, merge_ticket, merge_state, out, lse, out_partial, lse_partial)

    return SimpleNamespace(merge_begin=merge_begin, merge_end=merge_end, merge_weights=merge_weights,
                           merge_add=merge_add, merge_other=merge_other, store_direct=store_direct,
                           make_store_segment=make_store_segment, wg0_store_segment=wg0_store_segment,
                           wg1_store_segment=wg1_store_segment, send_l=send_l, receive_l=receive_l,
                           wg0_end_segment=wg0_end_segment)
