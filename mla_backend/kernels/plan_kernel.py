"""The split-KV planner as one TileLang kernel (sm90): ``planner.SplitPlanner.plan`` in a single launch.

The torch version is ~18 small device ops (47 µs of GPU time per step on the H100 with the L2 flushed, most of it
per-op launch cost); this kernel does the same in one program of 256 threads: KV blocks per request into shared
memory, one warp's prefix sum (``T.cumsum``), then one thread per part binary-searches its first and last request.
Batch and part count are runtime values; a variant is keyed by the shared-memory size (max batch rounded up to a
power of two), the KV block size and whether it waits for the stream's previous kernel (``KernelConfig.pdl``, as the
decode kernels do: a launch that TileLang makes with programmatic stream serialisation allowed, e.g. under
``TILELANG_EXECUTION_BACKEND=cython``, may otherwise read ``kv_lens`` before its writer has finished).
"""

import threading

import tilelang.language as T

from .configs import config_for, target_for_arch
from .common import wait_for_inputs

THREADS = 256  # one per part at most: planner.MAX_PARTS
_KERNELS: dict[tuple, object] = {}
_LOCK = threading.Lock()


def scan_size(max_batch: int) -> int:
    """Entries of the shared prefix-sum buffer: max_batch rounded up to a power of two, 256 at least."""
    return 1 << max(8, (max(max_batch, 1) - 1).bit_length())


def build_plan_kernel(max_batch: int, block_n: int, pdl: bool = False):
    """Returns ``mla_plan(kv_lens, cu_blocks, part_begin_req, part_end_req, blocks_per_part, num_parts,
    min_blocks, segment_cost)``: kv_lens int32 ``[batch]`` (1 <= batch <= max_batch); cu_blocks int32 ``[>= batch + 1]``;
    part_begin_req / part_end_req int32 ``[>= num_parts]``; blocks_per_part int32 ``[1]``; num_parts <= 256.
    The width is the torch planner's: the even cut or the one aligned to the longest request, by ``plan_cost`` with
    ``segment_cost`` blocks per segment (0: always the even cut); each thread folds its requests, then warp shuffles
    and one shared slot per warp. ``pdl``: wait for the stream's previous kernel before the first read or write."""
    warps = THREADS // 32
    n = scan_size(max_batch)
    steps = n.bit_length()  # binary-search rounds over n entries
    batch = T.dynamic("batch")
    cu_len = T.dynamic("cu_len")
    parts_len = T.dynamic("parts_len")

    @T.prim_func
    def mla_plan(
        kv_lens: T.Tensor([batch], "int32"),
        cu_blocks: T.Tensor([cu_len], "int32"),
        part_begin_req: T.Tensor([parts_len], "int32"),
        part_end_req: T.Tensor([parts_len], "int32"),
        blocks_per_part: T.Tensor([1], "int32"),
        num_parts: T.int32,
        min_blocks: T.int32,
        segment_cost: T.int32,
    ):
        with T.Kernel(1, threads=THREADS):
            cu_s = T.alloc_shared([n], "int32")  # cu_s[r] = cu_blocks[r + 1]
            # per warp: its longest request (blocks), its requests' segments under the even and the aligned cut
            warp_stat = T.alloc_shared([3, warps], "int32")
            acc = T.alloc_var("int32")
            acc_aligned = T.alloc_var("int32")
            longest = T.alloc_var("int32")
            seg_even = T.alloc_var("int32")
            seg_aligned = T.alloc_var("int32")
            even = T.alloc_var("int32")
            aligned = T.alloc_var("int32")
            width = T.alloc_var("int32")
            # a part's search window [lo, hi) for its first request (b) and its last (e)
            b_lo = T.alloc_var("int32")
            b_hi = T.alloc_var("int32")
            e_lo = T.alloc_var("int32")
            e_hi = T.alloc_var("int32")
            tx = T.get_thread_binding()
            wait_for_inputs(pdl)
            for i in T.Parallel(n):
                cu_s[i] = T.if_then_else(i < batch, (kv_lens[T.min(i, batch - 1)] + (block_n - 1)) // block_n, 0)
            acc = 0
            for k in T.serial(n // THREADS):  # entries past the batch hold 0
                acc = T.max(acc, cu_s[k * THREADS + tx])
            acc = T.warp_reduce_max(acc)
            if tx % 32 == 0:
                warp_stat[0, tx // 32] = acc
            T.cumsum(cu_s, dim=0)
            total = cu_s[batch - 1]
            longest = 1
            for w in T.serial(warps):
                longest = T.max(longest, warp_stat[0, w])
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
            for i in T.Parallel(n):
                if i < batch:
                    cu_blocks[i + 1] = cu_s[i]
            if tx == 0:
                cu_blocks[0] = 0
                blocks_per_part[0] = width
            if tx < num_parts:
                # part tx covers blocks [lo, hi); its first request is the first r with cu[r + 1] > lo, its last the
                # first with cu[r + 1] > hi - 1 (torch.searchsorted(cu[1:], ..., right=True))
                lo = tx * width
                hi = T.min(lo + width, total)
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
                part_begin_req[tx] = b_lo
                # empty part (lo >= total): the split kernel's request loop runs zero times
                part_end_req[tx] = T.if_then_else(hi > lo, e_lo, b_lo - 1)

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
