"""The split-KV planner as one TileLang kernel (sm90): ``planner.SplitPlanner.plan`` in a single launch, with the
balanced cut (``planner.balanced_cut``) where it pays.

The torch version is ~18 small device ops (47 µs of GPU time per step on the H100 with the L2 flushed, most of it
per-op launch cost); this kernel is one program of 256 threads: KV blocks per request into shared memory, one warp's
prefix sum (``T.cumsum``), the one-width cut (the torch planner's) and its costliest part, then the cheapest cost cap
a greedy fill meets, found by rounds in which each thread tests one cap (a serial walk over the requests, O(1) per
request), and where that cap is ``BALANCED_MIN_GAIN`` cheaper, one thread's walk writes the balanced cut. Last, one
thread per part binary-searches its first and last request. Batch and part count are runtime values; a variant is
keyed by the shared-memory size (max batch rounded up to a power of two), the KV block size and whether it waits for
the stream's previous kernel (``KernelConfig.pdl``, as the decode kernels do: a launch that TileLang makes with
programmatic stream serialisation allowed, e.g. under ``TILELANG_EXECUTION_BACKEND=cython``, may otherwise read
``kv_lens`` before its writer has finished).
"""

import threading

import tilelang.language as T

from ..constants import MAX_PARTS
from ..planner import BALANCED_MIN_GAIN
from .configs import config_for, target_for_arch
from .common import wait_for_inputs

THREADS = 256  # one per part at most: planner.MAX_PARTS
CAP_ROUNDS = 3  # most cap-search rounds of THREADS candidates: a window of up to 256^3 caps
_KERNELS: dict[tuple, object] = {}
_LOCK = threading.Lock()


def scan_size(max_batch: int) -> int:
    """Entries of the shared prefix-sum buffer: max_batch rounded up to a power of two, 256 at least."""
    return 1 << max(8, (max(max_batch, 1) - 1).bit_length())


def build_plan_kernel(max_batch: int, block_n: int, pdl: bool = False):
    """Returns ``mla_plan(kv_lens, cu_blocks, part_begin_req, part_end_req, part_start, req_parts, num_parts,
    min_blocks, segment_cost)``: kv_lens int32 ``[batch]`` (1 <= batch <= max_batch); cu_blocks int32
    ``[>= batch + 1]``; part_begin_req / part_end_req int32 ``[>= num_parts]``; part_start int32 ``[>= num_parts + 1]``;
    req_parts int32 ``[>= 2 batch]``; num_parts <= 256. The one-width cut is the torch planner's (the even cut or the
    one aligned to the longest request, by ``plan_cost`` with ``segment_cost`` blocks per segment); ``pdl``: wait for
    the stream's previous kernel before the first read or write."""
    warps = THREADS // 32
    n = scan_size(max_batch)
    steps = n.bit_length()  # binary-search rounds over n entries
    gain_num, gain_den = BALANCED_MIN_GAIN
    batch = T.dynamic("batch")
    cu_len = T.dynamic("cu_len")
    parts_len = T.dynamic("parts_len")
    starts_len = T.dynamic("starts_len")
    req_len = T.dynamic("req_len")

    @T.macro
    def fill_request(nb, cap, segment_cost, used: T.Ref, opens: T.Ref, take: T.Ref, more: T.Ref):
        """One request of ``nb`` blocks in the greedy fill up to ``cap`` (``planner.greedy_starts``): whether it opens
        a part, the blocks it takes in its first part, the parts it opens after that, and the cost then used."""
        room = T.max(cap - segment_cost, 1)  # the most blocks one segment of a fresh part takes
        opens = T.if_then_else(cap - used - segment_cost < 1, 1, 0)
        take = T.min(nb, T.if_then_else(opens == 1, room, cap - used - segment_cost))
        more = (nb - take + room - 1) // room
        used = T.if_then_else(more > 0, nb - take - (more - 1) * room + segment_cost,
                              T.if_then_else(opens == 1, 0, used) + take + segment_cost)

    @T.macro
    def find_requests(cu_s, lo, hi, b_lo: T.Ref, b_hi: T.Ref, e_lo: T.Ref, e_hi: T.Ref):
        """The first request of flat blocks [lo, hi) into b_lo (the first r with cu[r + 1] > lo) and its last into
        e_lo (the first with cu[r + 1] > hi - 1): torch.searchsorted(cu[1:], ..., right=True)."""
        b_lo = 0
        b_hi = batch
        e_lo = 0
        e_hi = batch
        for _ in T.serial(steps):
            if b_lo < b_hi:
                if cu_s[(b_lo + b_hi) // 2] <= lo:
                    b_lo = (b_lo + b_hi) // 2 + 1
                else:
                    b_hi = (b_lo + b_hi) // 2
            if e_lo < e_hi:
                if cu_s[(e_lo + e_hi) // 2] <= hi - 1:
                    e_lo = (e_lo + e_hi) // 2 + 1
                else:
                    e_hi = (e_lo + e_hi) // 2

    def block_reduce(warp_reduce, fold):
        @T.macro
        def reduce(value, tx, warp_stat, row, result: T.Ref):
            """``result`` folded with ``value`` of every thread of the program (in every thread): a warp shuffle,
            then one shared slot per warp in row ``row`` of ``warp_stat``."""
            T.sync_threads()
            v = warp_reduce(value)
            if tx % 32 == 0:
                warp_stat[row, tx // 32] = v
            T.sync_threads()
            for w in T.serial(warps):
                result = fold(result, warp_stat[row, w])

        return reduce

    block_max = block_reduce(T.warp_reduce_max, T.max)  # result raised to the largest value
    block_min = block_reduce(T.warp_reduce_min, T.min)  # result lowered to the smallest value

    @T.prim_func
    def mla_plan(
        kv_lens: T.Tensor([batch], "int32"),
        cu_blocks: T.Tensor([cu_len], "int32"),
        part_begin_req: T.Tensor([parts_len], "int32"),
        part_end_req: T.Tensor([parts_len], "int32"),
        part_start: T.Tensor([starts_len], "int32"),
        req_parts: T.Tensor([req_len], "int32"),
        num_parts: T.int32,
        min_blocks: T.int32,
        segment_cost: T.int32,
    ):
        with T.Kernel(1, threads=THREADS):
            cu_s = T.alloc_shared([n], "int32")  # cu_s[r] = cu_blocks[r + 1]
            start_s = T.alloc_shared([MAX_PARTS + 1], "int32")  # the cut: each part's first flat block
            # per warp: its longest request (blocks), its requests' segments under the even and the aligned cut, its
            # non-empty requests, the costliest part of the one-width cut, the largest infeasible cap
            warp_stat = T.alloc_shared([6, warps], "int32")
            acc = T.alloc_var("int32")
            acc_aligned = T.alloc_var("int32")
            longest = T.alloc_var("int32")
            seg_even = T.alloc_var("int32")
            seg_aligned = T.alloc_var("int32")
            requests = T.alloc_var("int32")
            even = T.alloc_var("int32")
            aligned = T.alloc_var("int32")
            width = T.alloc_var("int32")
            worst = T.alloc_var("int32")  # the one-width cut's costliest part
            low = T.alloc_var("int32")  # the cap search's window: caps below low fail, best is met
            best = T.alloc_var("int32")
            step = T.alloc_var("int32")
            failed = T.alloc_var("int32")
            parts = T.alloc_var("int32")
            used = T.alloc_var("int32")
            opens = T.alloc_var("int32")
            take = T.alloc_var("int32")
            more = T.alloc_var("int32")
            prev = T.alloc_var("int32")
            part = T.alloc_var("int32")
            b_lo = T.alloc_var("int32")
            b_hi = T.alloc_var("int32")
            e_lo = T.alloc_var("int32")
            e_hi = T.alloc_var("int32")
            tx = T.get_thread_binding()
            wait_for_inputs(pdl)
            for i in T.Parallel(n):
                cu_s[i] = T.if_then_else(i < batch, (kv_lens[T.min(i, batch - 1)] + (block_n - 1)) // block_n, 0)
            acc = 0
            acc_aligned = 0
            for k in T.serial(n // THREADS):  # entries past the batch hold 0
                acc = T.max(acc, cu_s[k * THREADS + tx])
                acc_aligned = acc_aligned + T.if_then_else(cu_s[k * THREADS + tx] > 0, 1, 0)
            acc = T.warp_reduce_max(acc)
            acc_aligned = T.warp_reduce_sum(acc_aligned)
            if tx % 32 == 0:
                warp_stat[0, tx // 32] = acc
                warp_stat[3, tx // 32] = acc_aligned
            T.cumsum(cu_s, dim=0)
            total = cu_s[batch - 1]
            longest = 1
            requests = 0
            for w in T.serial(warps):
                longest = T.max(longest, warp_stat[0, w])
                requests = requests + warp_stat[3, w]
            even = T.max((total + (num_parts - 1)) // num_parts, min_blocks)
            if longest >= even:
                aligned = (longest + longest // even - 1) // (longest // even)
            else:
                aligned = longest * ((even + longest - 1) // longest)
            acc = 0
            acc_aligned = 0
            for k in T.serial(n // THREADS):  # request i's segments: the parts its blocks [lo, hi) touch
                hi = cu_s[k * THREADS + tx]
                lo = T.if_then_else(k * THREADS + tx > 0, cu_s[T.max(k * THREADS + tx - 1, 0)], 0)
                if hi > lo:  # (past the batch hi == lo == total)
                    acc = acc + (hi - 1) // even - lo // even + 1
                    acc_aligned = acc_aligned + (hi - 1) // aligned - lo // aligned + 1
            acc = T.warp_reduce_sum(acc)
            acc_aligned = T.warp_reduce_sum(acc_aligned)
            if tx % 32 == 0:
                warp_stat[1, tx // 32] = acc
                warp_stat[2, tx // 32] = acc_aligned
            T.sync_threads()
            seg_even = 0
            seg_aligned = 0
            for w in T.serial(warps):
                seg_even = seg_even + warp_stat[1, w]
                seg_aligned = seg_aligned + warp_stat[2, w]
            width = T.if_then_else(aligned * num_parts + segment_cost * seg_aligned
                                   < even * num_parts + segment_cost * seg_even, aligned, even)

            # the one-width cut's costliest part: its blocks plus segment_cost per request it touches
            acc = 0
            if tx < num_parts:
                find_requests(cu_s, T.min(tx * width, total), T.min((tx + 1) * width, total), b_lo, b_hi, e_lo, e_hi)
                if T.min((tx + 1) * width, total) > tx * width:
                    acc = T.min((tx + 1) * width, total) - tx * width + segment_cost * (e_lo - b_lo + 1)
            worst = 0
            block_max(acc, tx, warp_stat, 4, worst)

            # the cheapest cap a greedy fill meets, in rounds: each thread tests one cap of the window (low, best]
            # (best = the one-width cut's cost, always met), and the next round searches between the largest failed
            # cap and the cheapest met one. Caps start at segment_cost + min_blocks: a fresh part takes min_blocks of a
            # long request at least, as the one-width cut does (past 32 rows a one-block part's partial outweighs it)
            low = T.max((total + segment_cost * requests + num_parts - 1) // num_parts, segment_cost + min_blocks) - 1
            best = worst
            # no search where no cut can gain BALANCED_MIN_GAIN (every cut has a part of cost low + 1 or more; equal
            # lengths mostly), else as many rounds as the window needs to shrink to one cap
            for _ in T.serial(T.if_then_else((low + 1) * gain_den >= best * gain_num, 0,
                                             T.if_then_else(best - low <= THREADS, 1,
                                                            T.if_then_else(best - low <= THREADS * THREADS, 2,
                                                                           CAP_ROUNDS)))):
                step = T.max((best - low + THREADS - 1) // THREADS, 1)
                cap = T.min(low + 1 + tx * step, best)
                parts = 1
                used = 0
                prev = 0
                for r in T.serial(batch):
                    if cu_s[r] > prev:
                        fill_request(cu_s[r] - prev, cap, segment_cost, used, opens, take, more)
                        parts = parts + opens + more
                    prev = cu_s[r]
                block_min(T.if_then_else(parts <= num_parts, cap, best), tx, warp_stat, 5, best)
                failed = T.if_then_else(parts <= num_parts, low, cap)  # this thread's cap, where it failed
                block_max(failed, tx, warp_stat, 4, low)

            if best * gain_den < worst * gain_num:
                # the balanced cut: one thread fills the parts up to best, writing the starts and each request's parts
                if tx == 0:
                    part = 0
                    used = 0
                    prev = 0
                    start_s[0] = 0
                    for r in T.serial(batch):
                        if cu_s[r] > prev:
                            fill_request(cu_s[r] - prev, best, segment_cost, used, opens, take, more)
                            part = part + opens
                            if opens == 1:
                                start_s[part] = prev
                            req_parts[2 * r] = part
                            req_parts[2 * r + 1] = 1 + more
                            for j in T.serial(more):
                                start_s[part + 1 + j] = prev + take + j * T.max(best - segment_cost, 1)
                            part = part + more
                        else:
                            req_parts[2 * r] = part
                            req_parts[2 * r + 1] = 0
                        prev = cu_s[r]
                    for p in T.serial(part + 1, num_parts + 1):
                        start_s[p] = total
            else:
                if tx <= num_parts:
                    start_s[tx] = T.min(tx * width, total)
                if tx == 0:
                    start_s[num_parts] = total  # (tx reaches num_parts only below 256 parts)
                for k in T.serial((n + THREADS - 1) // THREADS):
                    if k * THREADS + tx < batch:
                        hi = cu_s[k * THREADS + tx]
                        lo = T.if_then_else(k * THREADS + tx > 0, cu_s[T.max(k * THREADS + tx - 1, 0)], 0)
                        req_parts[2 * (k * THREADS + tx)] = lo // width
                        req_parts[2 * (k * THREADS + tx) + 1] = T.if_then_else(hi > lo, (hi - 1) // width - lo // width
                                                                               + 1, 0)
            T.sync_threads()
            if tx < num_parts:
                find_requests(cu_s, start_s[tx], start_s[tx + 1], b_lo, b_hi, e_lo, e_hi)
                part_begin_req[tx] = b_lo
                # empty part (lo >= total): the split kernel's request loop runs zero times
                part_end_req[tx] = T.if_then_else(start_s[tx + 1] > start_s[tx], e_lo, b_lo - 1)
                part_start[tx] = start_s[tx]
            for i in T.Parallel(n):
                if i < batch:
                    cu_blocks[i + 1] = cu_s[i]
            if tx == 0:
                cu_blocks[0] = 0
                part_start[num_parts] = total

    return mla_plan


def get_plan_kernel(max_batch: int, block_n: int):
    """The compiled planner kernel for plans of up to ``max_batch`` requests (sm_90a), compiled on first use."""
    pdl = config_for("sm90").pdl
    key = (scan_size(max_batch), block_n, pdl)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                import tilelang
                from tilelang import tvm

                from . import prebuilt

                prebuilt.seed(prebuilt.plan_name(key[0], block_n))
                kernel = _KERNELS[key] = tilelang.compile(build_plan_kernel(max_batch, block_n, pdl),
                                                          target=tvm.target.Target(target_for_arch("sm90")))
    return kernel
