"""Split-KV planner: cuts the flattened (request, KV block) work list into parts, one per SM and row block, on the GPU.

No host sync and no ``.item()``: every output is a device tensor computed by one kernel launch on Hopper
(kernels/plan_kernel.py) or a few torch ops elsewhere, and
the buffers' sizes depend only on (max batch, SM count, heads x q_len), so an engine can plan into
persistent buffers outside a CUDA graph and replay the graph with new lengths.

Part ``p`` covers flat blocks ``[part_start[p], part_start[p + 1])``. The torch planner cuts one width ``W`` for
every part: the even cut ``ceil(total / num_parts)``, or the cut aligned to the longest request where that is cheaper
by ``plan_cost`` (equal lengths then give parts of whole requests, or of equal pieces of one, instead of parts that
straddle two). The Hopper plan kernel starts from that cut and replaces it by :func:`balanced_cut` (a width per part)
where that lowers the costliest part's cost by ``BALANCED_MIN_GAIN``: a ragged batch's requests straddle parts of one
width, two segments in most of them, and the costliest part sets the kernel's time.
Request ``r`` touches parts ``req_parts[2 r] ..`` (``req_parts[2 r + 1]`` of them, 0 for an empty request) and is
split iff it touches more than one; its partial from part ``p`` goes to slot ``p + r``, so
``num_slots = num_parts + max_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import KV_LORA_RANK, MAX_PARTS
from .kernels.configs import config_for
from .metadata import INDEX_DTYPE, MLADecodeMetadata

# A part may hold a single block where its partial is small: the combine merges a request's partials with all their
# loads in flight, so spreading a short batch over every SM wins (b=1, s=4096, h=16: 64 one-block parts instead of 16
# of four). Past 32 rows a one-block part's partial (rows x 2 KB: 128 KB at 64 rows, written and read back) outweighs
# the 72 KB block it reads: two blocks at least (graph replay: b=1 s=4096 h=128 24.8 -> 21.8 us, b=4
# s=2048 h=64 25.4 -> 22.8; at 32 rows two blocks were 1-1.7 us slower, so those keep one).
MIN_BLOCKS_PER_PART = 1
MIN_BLOCKS_PER_PART_WIDE = 2
SMALL_PARTIAL_ROWS = 32
# What a request segment costs a part beyond its blocks, in blocks: its Q, its partial written and merged, the
# pipeline's restart. Fitted to an A/B on the H100 (benchmarks/RESULTS.md): parts aligned to equal requests
# (1-3 blocks wider, half the segments) were 2.4-9.8% faster at h=128 / 64 / 32 x s_q 2, 7 wider 1% faster at h=16
# b=128, and a 3% wider cut with a third fewer segments (b=128 s_k=16384 h=128: 497 -> 512) 1-3.6% slower.
SEGMENT_COST_BLOCKS = 8
# The plan kernel keeps the one-width cut unless the balanced cut's costliest part is this much cheaper (1/20): equal
# lengths keep the aligned cut that the A/B above chose, whose parts hold whole requests.
BALANCED_MIN_GAIN = (19, 20)


@dataclass
class SplitPlan:
    """Device buffers of one plan (shapes are maxima; the kernels read the first ``batch`` rows).

    cu_blocks: int32 ``[max_batch + 1]`` prefix sum of KV blocks per request.
    part_begin_req / part_end_req: int32 ``[num_parts]`` first / last request each part touches
        (``end < begin`` for an empty part).
    part_start: int32 ``[num_parts + 1]``: the flat block where each part starts (non-decreasing; the last entry and
        those of unused parts the total).
    req_parts: int32 ``[2 * max_batch]``: per request its first part and its number of parts (0 if empty).
    out_partial: fp32 ``[num_parts + max_batch, rows, 512]``; lse_partial: fp32 ``[.., rows]`` (log2).
    """

    cu_blocks: torch.Tensor
    part_begin_req: torch.Tensor
    part_end_req: torch.Tensor
    part_start: torch.Tensor
    req_parts: torch.Tensor
    out_partial: torch.Tensor
    lse_partial: torch.Tensor
    num_parts: int
    rows: int
    block_n: int  # KV tokens per block of work: the kernel checks it equals its own block_n


def min_blocks_per_part(rows: int) -> int:
    """The fewest KV blocks a part of a plan for ``rows`` (heads x q_len) query rows holds."""
    return MIN_BLOCKS_PER_PART if rows <= SMALL_PARTIAL_ROWS else MIN_BLOCKS_PER_PART_WIDE


def aligned_width(longest: torch.Tensor, even: torch.Tensor) -> torch.Tensor:
    """The narrowest width >= ``even`` that cuts a request of ``longest`` (>= 1) blocks into equal whole pieces
    (``ceil(longest / k)``) or packs whole such requests (a multiple of ``longest``); int tensors ``[1]``."""
    return torch.where(longest >= even, -(-longest // torch.clamp(longest // even, min=1)),
                       longest * -(-even // longest))


def plan_cost(width, segments, num_parts, segment_cost):
    """A plan's cost in blocks x parts: each part's width plus what its share of the request segments costs."""
    return width * num_parts + segment_cost * segments


def num_parts_for(num_sms: int, num_heads: int, q_len: int, block_rows: int = 64) -> int:
    """One part per SM and row block: ``rows`` tiles of ``block_rows`` share the SMs (at most ``MAX_PARTS``)."""
    row_blocks = -(-num_heads * q_len // block_rows)
    return min(MAX_PARTS, max(1, num_sms // row_blocks))


def device_config(device: torch.device):
    """The tile config of the kernel that will run on ``device`` (Hopper's off-GPU)."""
    from .dispatch import device_arch

    return config_for(device_arch(device)[0] or "sm90")


def default_block_n(device: torch.device) -> int:
    """The KV block of the kernel that will run on ``device`` (Hopper's default config off-GPU)."""
    return device_config(device).block_n


def plan_kernel_for(device: torch.device, max_batch: int, block_n: int):
    """The one-launch TileLang planner (kernels/plan_kernel.py) where the sm90 kernels run, else None (torch ops)."""
    from .dispatch import device_arch, tilelang_available

    if device_arch(device)[0] != "sm90" or not tilelang_available():
        return None
    from .kernels.plan_kernel import get_plan_kernel

    return get_plan_kernel(max_batch, block_n)


def warm_up_plan_kernels(device: torch.device, max_batch: int) -> int:
    """Compiles (or loads from TileLang's disk cache) the one-launch planner for every plan size up to ``max_batch``
    requests (one variant per power of two from 256), so that no planner an engine builds later compiles while it
    serves. Returns the number of variants (0 where plans use torch ops)."""
    from .kernels.plan_kernel import scan_size

    device, block_n = torch.device(device), default_block_n(torch.device(device))
    sizes = [1 << k for k in range(scan_size(1).bit_length() - 1, scan_size(max_batch).bit_length())]
    return sum(plan_kernel_for(device, n, block_n) is not None for n in sizes)


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class SplitPlanner:
    """Owns persistent plan buffers for up to ``max_batch`` requests; ``plan()`` refills them in place."""

    def __init__(self, max_batch: int, num_heads: int, q_len: int, device: torch.device | str,
                 num_sms: int | None = None, block_n: int | None = None):
        device = torch.device(device)
        self.max_batch, self.block_n = max_batch, block_n or default_block_n(device)
        self.num_sms = num_sms or device_sm_count(device)
        # gfx942's tiles hold 16 rows, not 64: its row blocks, and so its parts per SM, follow from its config
        self.num_parts = num_parts_for(self.num_sms, num_heads, q_len, device_config(device).block_rows)
        self.segment_cost = SEGMENT_COST_BLOCKS
        rows = num_heads * q_len
        i32 = dict(dtype=INDEX_DTYPE, device=device)
        self._plan = SplitPlan(
            cu_blocks=torch.zeros(max_batch + 1, **i32),
            part_begin_req=torch.zeros(self.num_parts, **i32),
            part_end_req=torch.zeros(self.num_parts, **i32),
            part_start=torch.zeros(self.num_parts + 1, **i32),
            req_parts=torch.zeros(2 * max_batch, **i32),
            out_partial=torch.empty(self.num_parts + max_batch, rows, KV_LORA_RANK, dtype=torch.float32, device=device),
            lse_partial=torch.empty(self.num_parts + max_batch, rows, dtype=torch.float32, device=device),
            num_parts=self.num_parts,
            rows=rows,
            block_n=self.block_n,
        )
        self._part_ids = torch.arange(self.num_parts + 1, **i32)
        self._min_blocks = min_blocks_per_part(rows)
        # compiled here, before an engine captures its graphs: one launch per plan instead of ~18 torch ops
        kernel = plan_kernel_for(device, max_batch, self.block_n)
        if kernel is not None:
            from .kernels.runtime import launch_entry

            kernel = launch_entry(kernel, 8)
        self._kernel = kernel

    @property
    def buffers(self) -> SplitPlan:
        """The persistent plan this planner refills in place (its tensors keep their addresses: an engine may hand
        them to a CUDA graph once)."""
        return self._plan

    def plan(self, kv_lens: torch.Tensor) -> SplitPlan:
        """Refill the plan for ``kv_lens`` (int32 ``[batch]``, batch <= max_batch); device ops only."""
        batch = kv_lens.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the planner's max_batch {self.max_batch}")
        p = self._plan
        if self._kernel is not None and batch > 0 and kv_lens.dtype == INDEX_DTYPE and kv_lens.is_contiguous():
            self._kernel(kv_lens, p.cu_blocks, p.part_begin_req, p.part_end_req, p.part_start, p.req_parts,
                         self.num_parts, self._min_blocks, self.segment_cost)
            return p
        blocks = (kv_lens + (self.block_n - 1)) // self.block_n
        cu = p.cu_blocks[: batch + 1]
        torch.cumsum(blocks, 0, out=cu[1:])
        total = cu[batch:]  # [1]
        even = torch.clamp((total + (self.num_parts - 1)) // self.num_parts, min=self._min_blocks)
        longest = torch.clamp(blocks.max().reshape(1), min=1) if batch else torch.ones_like(even)
        aligned = aligned_width(longest, even)

        def parts_touched(w):  # per request, the parts of the cut of width w that it touches (0 if empty)
            return torch.where(blocks > 0, (cu[1:] - 1) // w - cu[:-1] // w + 1, 0)

        width = torch.where(plan_cost(aligned, parts_touched(aligned).sum(), self.num_parts, self.segment_cost)
                            < plan_cost(even, parts_touched(even).sum(), self.num_parts, self.segment_cost),
                            aligned, even)
        starts = torch.minimum(self._part_ids * width, total)  # [num_parts + 1]
        p.part_start.copy_(starts)
        lo, hi = starts[:-1], starts[1:]
        begin = torch.searchsorted(cu[1:], lo, right=True, out_int32=True)
        end = torch.searchsorted(cu[1:], hi - 1, right=True, out_int32=True)
        p.part_begin_req.copy_(begin)
        # empty part (lo >= total): make the request loop run zero times
        p.part_end_req.copy_(torch.where(hi > lo, end, begin - 1))
        p.req_parts[: 2 * batch].view(batch, 2).copy_(torch.stack((cu[:-1] // width, parts_touched(width)), dim=1))
        return p


def balanced_cut(blocks: list[int], num_parts: int, segment_cost: int,
                 min_blocks: int = 1) -> tuple[int, list[int]]:
    """The cut with a width per part whose costliest part is the cheapest, as the Hopper plan kernel makes it (pure
    Python, for tests and scripts). A part's cost is its blocks plus ``segment_cost`` per request segment in it.
    Caps start at ``segment_cost + min_blocks``, so that a fresh part takes ``min_blocks`` (``min_blocks_per_part``)
    of a long request, as the one-width cut does.

    Filling each part up to a cost cap is optimal for that cap (a part that stops early leaves the next one at least
    as much work), so the cheapest feasible cap is found by search and the cut is its greedy fill.
    Returns (the costliest part's cost, part starts ``[num_parts + 1]``)."""
    total, requests = sum(blocks), sum(1 for n in blocks if n)
    if total == 0:
        return 0, [0] * (num_parts + 1)
    hi = total + segment_cost * requests  # every block in one part: always met
    lo = min(max(-(-hi // num_parts), segment_cost + min_blocks), hi)
    while lo < hi:
        cap = (lo + hi) // 2
        if len(greedy_starts(blocks, cap, segment_cost)) <= num_parts:
            hi = cap
        else:
            lo = cap + 1
    starts = greedy_starts(blocks, lo, segment_cost)
    return lo, starts + [total] * (num_parts + 1 - len(starts))


def hopper_cut(plan: SplitPlan, blocks: list[int], segment_cost: int) -> list[int] | None:
    """The Hopper plan kernel's choice, in Python: the part starts of :func:`balanced_cut` where its costliest part is
    ``BALANCED_MIN_GAIN`` cheaper than that of ``plan``'s one-width cut (the torch planner's), else None (the kernel
    keeps one width). ``blocks``: KV blocks per request."""
    worst = max(part_costs(blocks, plan.part_start.tolist(), segment_cost))
    best, starts = balanced_cut(blocks, plan.num_parts, segment_cost, min_blocks_per_part(plan.rows))
    return starts if best * BALANCED_MIN_GAIN[1] < worst * BALANCED_MIN_GAIN[0] else None


def greedy_starts(blocks: list[int], cap: int, segment_cost: int) -> list[int]:
    """Start blocks of the parts that filling each part up to ``cap`` makes (``cap > segment_cost``)."""
    starts, used, flat = [0], 0, 0
    room = cap - segment_cost  # the most blocks one segment of a fresh part takes
    for n in blocks:
        while n:
            take = min(n, cap - used - segment_cost)
            if take < 1:
                starts.append(flat)
                used, take = 0, min(n, room)
            used, n, flat = used + take + segment_cost, n - take, flat + take
            if n:
                starts.append(flat)
                used = 0
    return starts


def part_costs(blocks: list[int], starts: list[int], segment_cost: int) -> list[int]:
    """Each part's cost under the cut ``starts`` (``[num_parts + 1]``): its blocks plus its request segments."""
    cu = [0]
    for n in blocks:
        cu.append(cu[-1] + n)
    return [(hi - lo) + segment_cost * sum(1 for r in range(len(blocks)) if max(lo, cu[r]) < min(hi, cu[r + 1]))
            if hi > lo else 0 for lo, hi in zip(starts, starts[1:])]


_PLANNERS: dict[tuple, SplitPlanner] = {}


def plan_split_kv(metadata: MLADecodeMetadata, num_heads: int) -> SplitPlan:
    """Plan for one call (standalone use). Engines keep a :class:`SplitPlanner` and plan once per step."""
    batch = metadata.batch_size
    key = (metadata.device, num_heads, metadata.q_len, default_block_n(metadata.device))
    planner = _PLANNERS.get(key)
    if planner is None or planner.max_batch < batch:
        planner = SplitPlanner(max(batch, 1), num_heads, metadata.q_len or 1, metadata.device)
        _PLANNERS[key] = planner
    return planner.plan(metadata.kv_lens)
