"""Split-KV planner on CPU tensors: plan invariants, buffer sizes, and a pure-Python run of the
kernels' split + combine driven by the plan, checked against the reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mla_backend import SplitPlanner, mla_decode_reference, plan_split_kv
from mla_backend.kernels import configs
from mla_backend.kernels.configs import MAX_PARTS
from mla_backend.planner import (SEGMENT_COST_BLOCKS, balanced_cut, greedy_starts, hopper_cut, min_blocks_per_part,
                                 num_parts_for, part_costs, plan_cost, warm_up_plan_kernels)
from mla_problems import SCALE, fill_plan, make_problem

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


def random_lens(seed: int, batch: int, max_len: int) -> list[int]:
    """Ragged lengths with zeros, ones and block-boundary values mixed in."""
    rng = random.Random(seed)
    specials = [0, 1, 31, 32, 33, 0, 64]
    return [rng.choice(specials) if rng.random() < 0.3 else rng.randint(0, max_len) for _ in range(batch)]


def plan_lists(plan, batch):
    """The plan as Python lists: (cu_blocks [batch + 1], begin [parts], end [parts], starts [parts + 1],
    [(first part, number of parts)] per request)."""
    rp = plan.req_parts[: 2 * batch].tolist()
    return (plan.cu_blocks[: batch + 1].tolist(), plan.part_begin_req.tolist(), plan.part_end_req.tolist(),
            plan.part_start.tolist(), list(zip(rp[0::2], rp[1::2])))


def plan_width(plan):
    """The width of a one-width plan (the torch planner's): its first part's blocks."""
    return int(plan.part_start[1] - plan.part_start[0])


def segments(plan, batch):
    """What the split kernel does per part: [(part, req, blk_lo, blk_hi)] for non-empty segments,
    mirroring ``mla_decode_split``'s loop over ``part_begin_req[part] .. part_end_req[part]``."""
    cu, begin, end, starts, _ = plan_lists(plan, batch)
    out = []
    for part in range(plan.num_parts):
        part_lo, part_hi = starts[part], starts[part + 1]
        for req in range(begin[part], end[part] + 1):
            blk_lo = max(part_lo, cu[req]) - cu[req]
            blk_hi = min(part_hi, cu[req + 1]) - cu[req]
            if blk_hi > blk_lo:
                out.append((part, req, blk_lo, blk_hi))
    return out


CASES = [  # (heads, q_len, num_sms, batch, max_len)
    (16, 1, 132, 24, 3000),
    (128, 2, 132, 16, 2000),
    (16, 4, 8, 12, 400),
    (1, 1, 3, 9, 200),
    (64, 1, 132, 40, 50),  # short requests: few splits
]


@pytest.mark.parametrize("heads,q_len,num_sms,batch,max_len", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_invariants(heads, q_len, num_sms, batch, max_len, seed):
    planner = SplitPlanner(batch + 3, heads, q_len, device="cpu", num_sms=num_sms)
    lens = random_lens(seed, batch, max_len)
    plan = planner.plan(torch.tensor(lens, dtype=torch.int32))
    cu, begin, end, starts, req_parts = plan_lists(plan, batch)
    width = plan_width(plan)
    block_n = planner.block_n
    assert cu == [0] + list(torch.tensor([-(-n // block_n) for n in lens]).cumsum(0).tolist())
    assert starts == [min(p * width, cu[-1]) for p in range(plan.num_parts + 1)]
    assert (width >= min_blocks_per_part(heads * q_len) or cu[-1] < min_blocks_per_part(heads * q_len)) and \
        width * plan.num_parts >= cu[-1]

    # every (request, block) pair is covered by exactly one part
    covered = [(req, b) for _, req, lo, hi in segments(plan, batch) for b in range(lo, hi)]
    expected = [(r, b) for r in range(batch) for b in range(cu[r + 1] - cu[r])]
    assert sorted(covered) == expected

    # part_begin_req / part_end_req are exactly the first / last request a part touches
    for part in range(plan.num_parts):
        lo, hi = starts[part], starts[part + 1]
        touched = [r for r in range(batch) if max(lo, cu[r]) < min(hi, cu[r + 1])]
        if touched:
            assert (begin[part], end[part]) == (touched[0], touched[-1]), part
        else:
            assert end[part] < begin[part], part  # empty part: the request loop runs zero times

    # each request's first part and number of parts are the parts its blocks touch
    for r in range(batch):
        parts = [p for p in range(plan.num_parts) if max(starts[p], cu[r]) < min(starts[p + 1], cu[r + 1])]
        assert req_parts[r] == ((parts[0], len(parts)) if parts else (req_parts[r][0], 0)), r

    # partial slots (part + req) of split requests are unique and inside the buffers
    split_slots = [part + req for part, req, _, _ in segments(plan, batch) if req_parts[req][1] > 1]
    assert len(split_slots) == len(set(split_slots))
    assert all(0 <= s < plan.out_partial.shape[0] for s in split_slots)


def test_buffer_shapes_depend_only_on_max_batch_sms_and_rows():
    a = SplitPlanner(32, 16, 2, device="cpu", num_sms=132)
    b = SplitPlanner(32, 32, 1, device="cpu", num_sms=132)  # same rows = heads * q_len
    shapes = lambda p: {k: tuple(getattr(p, k).shape) for k in  # noqa: E731
                        ("cu_blocks", "part_begin_req", "part_end_req", "part_start", "req_parts", "out_partial",
                         "lse_partial")}
    buffers = a.buffers
    ptrs = [t.data_ptr() for t in (buffers.cu_blocks, buffers.part_begin_req, buffers.out_partial)]
    seen = set()
    for seed, batch in enumerate([1, 5, 32, 0, 17]):
        lens = torch.tensor(random_lens(seed, batch, 5000 * seed + 10), dtype=torch.int32)
        pa, pb = a.plan(lens), b.plan(lens)
        seen.add(tuple(shapes(pa).items()))
        assert shapes(pa) == shapes(pb)
        assert pa is buffers  # refilled in place: CUDA graphs keep pointing at the same memory
        assert [t.data_ptr() for t in (pa.cu_blocks, pa.part_begin_req, pa.out_partial)] == ptrs
    assert len(seen) == 1
    parts = num_parts_for(132, 16, 2)
    assert shapes(a.buffers) == {"cu_blocks": (33,), "part_begin_req": (parts,), "part_end_req": (parts,),
                               "part_start": (parts + 1,), "req_parts": (64,), "out_partial": (parts + 32, 32, 512),
                               "lse_partial": (parts + 32, 32)}
    # one part per SM and 64-row tile
    assert num_parts_for(132, 128, 1) == 66 and num_parts_for(132, 16, 1) == 132 and num_parts_for(132, 128, 4) == 16
    # the combine kernel holds one LSE per part of a request in shared memory: never more than MAX_PARTS parts
    assert num_parts_for(1000, 16, 1) == MAX_PARTS


def test_batch_over_max_batch_is_refused():
    planner = SplitPlanner(4, 16, 1, device="cpu", num_sms=132)
    with pytest.raises(ValueError, match="batch 5 exceeds the planner's max_batch 4"):
        planner.plan(torch.ones(5, dtype=torch.int32))


def test_all_empty_requests():
    planner = SplitPlanner(6, 16, 1, device="cpu", num_sms=132)
    plan = planner.plan(torch.zeros(6, dtype=torch.int32))
    assert segments(plan, 6) == []
    assert (plan.part_end_req < plan.part_begin_req).all()


def test_plan_kernel_warm_up_is_a_no_op_off_hopper():
    """Off Hopper plans are torch ops: nothing to compile (tests/test_kernel_gpu.py covers the sm90 side)."""
    assert warm_up_plan_kernels(torch.device("cpu"), 1000) == 0
    assert SplitPlanner(1000, 16, 1, device="cpu", num_sms=132)._kernel is None


def test_plan_split_kv_reuses_planner():
    p = make_problem([10, 100], 16, 1, 16)
    md = p.metadata()
    first = plan_split_kv(md, 16)
    assert plan_split_kv(md, 16) is first
    assert first.cu_blocks[:3].tolist()[-1] == sum(-(-n // configs.config_for("sm90").block_n) for n in p.lens)


# ----------------------------------------------------------------------------- split + combine run
def simulate(plan, p, block_n: int, scale: float = SCALE):
    """Pure-Python mirror of mla_decode_split + mla_decode_combine (fp64, log2 domain).

    Returns (out [T, H, 512], lse [T, H]) and asserts that every slot the combine reads was written
    by the split step and every output row was written once.
    """
    batch, q_len = len(p.lens), p.q_lens[0]
    num_tokens, heads, _ = p.q.shape
    cu, _, _, _, req_parts = plan_lists(plan, batch)
    flat = p.kv_cache.reshape(-1, 576).double()
    out = torch.full((num_tokens, heads, 512), float("nan"), dtype=torch.float64)
    lse = torch.full((num_tokens, heads), float("nan"), dtype=torch.float64)
    partial_o, partial_lse = {}, {}

    for part, req, blk_lo, blk_hi in segments(plan, batch):
        kv_len, tok0 = p.lens[req], req * q_len
        positions = torch.arange(blk_lo * block_n, blk_hi * block_n)
        clamped = positions.clamp(max=kv_len - 1)  # rows past kv_len re-read the last row, as the kernel does
        rows = [p.pages[req][t // p.page_size] * p.page_size + t % p.page_size for t in clamped.tolist()]
        kv = flat[rows]  # [n, 576]
        q = p.q[tok0: tok0 + q_len].double()  # [q_len, H, 576]
        s2 = torch.einsum("ihd,nd->ihn", q, kv) * scale * LOG2E
        visible = positions[None, :] < (kv_len - q_len + 1 + torch.arange(q_len))[:, None]  # [q_len, n]
        s2 = s2.masked_fill(~visible[:, None, :], -math.inf)
        m = s2.amax(-1)
        m_off = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        prob = torch.exp2(s2 - m_off[..., None])
        l_sum = prob.sum(-1)
        o = torch.einsum("ihn,nd->ihd", prob, kv[:, :512]) / torch.where(l_sum > 0, l_sum, 1)[..., None]
        lse2 = torch.where(l_sum > 0, torch.log2(l_sum) + m, torch.full_like(m, -math.inf))
        if req_parts[req][1] == 1:  # whole request in this part: direct write
            assert torch.isnan(out[tok0: tok0 + q_len]).all(), "output row written twice"
            out[tok0: tok0 + q_len], lse[tok0: tok0 + q_len] = o, lse2 * LN2
        else:
            slot = part + req
            assert slot not in partial_o, f"slot {slot} written twice"
            partial_o[slot], partial_lse[slot] = o, lse2

    for req in range(batch):  # combine: one program per request
        tok0, lo, hi = req * q_len, cu[req], cu[req + 1]
        first, last = req_parts[req][0], req_parts[req][0] + req_parts[req][1] - 1
        if hi == lo:
            out[tok0: tok0 + q_len], lse[tok0: tok0 + q_len] = 0.0, -math.inf
        elif last > first:
            slots = [s + req for s in range(first, last + 1)]
            assert all(s in partial_o for s in slots), "combine reads a slot the split never wrote"
            lses = torch.stack([partial_lse[s] for s in slots])  # [n, q_len, H]
            lse_max = lses.amax(0)
            off = torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)
            w = torch.exp2(lses - off)
            total = w.sum(0)
            w = torch.where(total > 0, w / total, torch.zeros_like(w))
            out[tok0: tok0 + q_len] = sum(w[k][..., None] * partial_o[s] for k, s in enumerate(slots))
            lse[tok0: tok0 + q_len] = torch.where(torch.isneginf(lse_max), lse_max, (torch.log2(total) + off) * LN2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "an output row was never written"
    return out, lse


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("heads,q_len,num_sms,batch,max_len", CASES)
def test_split_and_combine_follow_the_reference(heads, q_len, num_sms, batch, max_len, balanced):
    lens = random_lens(heads + q_len, batch, max_len)
    lens[0] = q_len - 1 if q_len > 1 else 0  # a request whose first queries see nothing
    p = make_problem(lens, heads, q_len, 16, torch.bfloat16, seed=num_sms)
    planner = SplitPlanner(batch, heads, q_len, device="cpu", num_sms=num_sms)
    assert planner.block_n == configs.config_for("sm90").block_n, "the planner's blocks must be the kernel's blocks"
    plan = planner.plan(torch.tensor(lens, dtype=torch.int32))
    if balanced:  # the plan kernel's cut with a width per part
        blocks = [-(-n // planner.block_n) for n in lens]
        fill_plan(plan, blocks, balanced_cut(blocks, plan.num_parts, SEGMENT_COST_BLOCKS)[1])
    n_split = sum(count > 1 for _, count in plan_lists(plan, batch)[4])
    if max_len >= 400:
        assert n_split > 0, "this case should exercise the combine path"
    out, lse = simulate(plan, p, planner.block_n)
    ref_out, ref_lse = mla_decode_reference(p.q[..., :512], p.q[..., 512:], p.kv_cache, p.metadata(), SCALE)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # the reference rounds its output to bf16; the simulation stays in fp64
    torch.testing.assert_close(out, ref_out.double(), rtol=1e-2, atol=1e-3)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].double(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("heads,q_len,width", [(16, 1, 1), (16, 2, 1), (32, 1, 1), (64, 1, 2), (128, 1, 2), (16, 4, 2)])
def test_short_batch_parts_hold_two_blocks_past_32_rows(heads, q_len, width):
    """b=1, 4096 tokens (64 blocks) on 132 SMs: one-block parts up to 32 rows; beyond, a one-block part's partial
    (rows x 2 KB) would outweigh its 72 KB block, so parts hold two (b=1 h=128: 24.8 -> 21.8 µs)."""
    plan = SplitPlanner(1, heads, q_len, device="cpu", num_sms=132).plan(torch.tensor([4096], dtype=torch.int32))
    assert plan_width(plan) == width


def width_and_segments(batch, tokens, heads, q_len, segment_cost=None):
    """Width of the plan for ``batch`` requests of ``tokens`` each on 132 SMs, and its request segments
    (``segment_cost`` 0: no cut but the even one is ever cheaper)."""
    planner = SplitPlanner(batch, heads, q_len, device="cpu", num_sms=132, block_n=64)
    if segment_cost is not None:
        planner.segment_cost = segment_cost
    plan = planner.plan(torch.full((batch,), tokens, dtype=torch.int32))
    return plan_width(plan), len(segments(plan, batch))


@pytest.mark.parametrize("batch,tokens,heads,q_len,even,aligned", [
    (64, 4096, 128, 1, 63, 64),  # 64 parts of one request instead of 66 that each straddle two
    (128, 4096, 64, 1, 63, 64),
    (64, 4096, 64, 2, 63, 64),
    (128, 4096, 128, 1, 125, 128),  # two whole requests per part
    (16, 16384, 128, 1, 63, 64),  # four equal pieces of each request
    (128, 16384, 16, 1, 249, 256),
])
def test_equal_lengths_get_parts_aligned_to_the_requests(batch, tokens, heads, q_len, even, aligned):
    """benchmarks/RESULTS.md: at fixed lengths, parts 1-7 blocks wider than the even cut that hold whole
    requests (or equal pieces of one) were 1-10% faster on the H100 than parts that straddle requests."""
    width, segs = width_and_segments(batch, tokens, heads, q_len)
    even_width, even_segs = width_and_segments(batch, tokens, heads, q_len, segment_cost=0)
    assert (width, even_width) == (aligned, even)
    blocks = tokens // 64
    assert segs == batch * max(1, blocks // aligned) < even_segs  # no request straddles a part boundary
    assert plan_cost(width, segs, num_parts_for(132, heads, q_len), SEGMENT_COST_BLOCKS) < plan_cost(
        even_width, even_segs, num_parts_for(132, heads, q_len), SEGMENT_COST_BLOCKS)


@pytest.mark.parametrize("batch,tokens,heads,q_len", [(128, 16384, 128, 1), (64, 32768, 128, 1), (128, 32768, 16, 1)])
def test_a_much_wider_aligned_cut_keeps_the_even_one(batch, tokens, heads, q_len):
    """497 -> 512 blocks per part (3%) for a third fewer segments measured 1-3.6% slower: the cost keeps the even cut."""
    width, _ = width_and_segments(batch, tokens, heads, q_len)
    assert width == -(-batch * tokens // 64 // num_parts_for(132, heads, q_len))


def test_ragged_lengths_keep_the_even_cut_unless_aligning_is_cheaper():
    """Aligning to the longest of ragged requests cuts few segments: the plan is the even one there."""
    gen = torch.Generator().manual_seed(0)
    for batch, tokens, heads in [(64, 16384, 16), (128, 8192, 128), (128, 32768, 16)]:
        lens = torch.clamp(torch.normal(float(tokens), tokens / 2, (batch,), generator=gen), min=1).int()
        plan = SplitPlanner(batch, heads, 1, device="cpu", num_sms=132, block_n=64).plan(lens)
        total = int(((lens + 63) // 64).sum())
        assert plan_width(plan) == -(-total // num_parts_for(132, heads, 1))


def test_num_parts_follow_the_tile_rows():
    """Hopper's 64-row tiles vs gfx942's 16-row tiles: 128 heads on an MI300X's 304 CUs are 8 row blocks of 16, so 38
    parts give one workgroup per CU, not 152 parts (four rounds)."""
    from mla_backend.planner import num_parts_for

    assert num_parts_for(132, 128, 1, 64) == 66
    assert num_parts_for(304, 128, 1, 16) == 38
    assert num_parts_for(304, 16, 1, 16) == 256  # capped at MAX_PARTS


# ----------------------------------------------------------------------------- the balanced cut (a width per part)
def cheapest_cut_by_search(blocks, num_parts, segment_cost):
    """The lowest costliest-part cost over every cut of the flat blocks into ``num_parts`` contiguous parts (parts may
    be empty), by exhaustive search over the cut positions: the oracle for ``balanced_cut`` on small batches."""
    import itertools

    total = sum(blocks)
    best = None
    for cuts in itertools.combinations_with_replacement(range(total + 1), num_parts - 1):
        starts = [0, *cuts, total]
        worst = max(part_costs(blocks, starts, segment_cost))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cut_is_the_cheapest_cut(seed):
    rng = random.Random(seed)
    blocks = [rng.choice([0, 1, 2, 3, 5, 7]) for _ in range(rng.randint(1, 4))]
    num_parts, segment_cost = rng.randint(1, 4), rng.choice([0, 1, 3])
    if sum(blocks) == 0 or sum(blocks) > 12:
        blocks = [3, 5]
    cost, starts = balanced_cut(blocks, num_parts, max(segment_cost, 1))
    assert len(starts) == num_parts + 1 and starts[0] == 0 and starts[-1] == sum(blocks)
    assert starts == sorted(starts)
    assert max(part_costs(blocks, starts, max(segment_cost, 1))) == cost
    assert cost == cheapest_cut_by_search(blocks, num_parts, max(segment_cost, 1))


@pytest.mark.parametrize("lens,heads,q_len,one_width,balanced", [
    # 64 requests of 4096-4300 tokens at 128 heads (an SGLang DP-attention rank's decode batch, ragged by the
    # staggered prefill): parts of 65 blocks hold two segments each; a width per part gives most one
    ("ragged-4k", 128, 1, 81, 76),
    ("short+long", 128, 1, 45, 36),  # 64 x ~1k + 1 x 16k: a served mixed load's decode batch
    ("equal-16k", 128, 1, 521, 520),  # 128 x 16k: the one-width cut is as good (within BALANCED_MIN_GAIN)
])
def test_balanced_cut_lowers_the_costliest_part_of_ragged_batches(lens, heads, q_len, one_width, balanced):
    """The planner's own cost model (SEGMENT_COST_BLOCKS per segment) on the H200's 132 SMs."""
    gen = random.Random(0)
    lens = {"ragged-4k": [gen.randrange(4096, 4300) for _ in range(64)],
            "short+long": [gen.randrange(900, 1200) for _ in range(64)] + [16384],
            "equal-16k": [16384] * 128}[lens]
    planner = SplitPlanner(len(lens), heads, q_len, device="cpu", num_sms=132, block_n=64)
    plan = planner.plan(torch.tensor(lens, dtype=torch.int32))
    blocks = [-(-n // 64) for n in lens]
    assert max(part_costs(blocks, plan.part_start.tolist(), SEGMENT_COST_BLOCKS)) == one_width
    cost, starts = balanced_cut(blocks, planner.num_parts, SEGMENT_COST_BLOCKS)
    assert cost == balanced and max(part_costs(blocks, starts, SEGMENT_COST_BLOCKS)) == balanced


def test_greedy_fill_opens_a_part_where_a_segment_does_not_fit():
    """Cap 10, 3 per segment: a fresh part takes at most 7 blocks of one request."""
    assert greedy_starts([5, 5], 10, 3) == [0, 5]  # 5 + 3 used: the next segment would have no block of room
    assert greedy_starts([20], 10, 3) == [0, 7, 14]  # one request over three parts
    assert greedy_starts([4, 0, 1], 10, 3) == [0, 4]  # empty requests cost nothing
    assert greedy_starts([2, 2], 10, 3) == [0]  # 2 + 3 + 2 + 3 = 10


def test_equal_lengths_keep_one_width_on_hopper():
    """On the bench grids' equal-length rows (H100 / H200: 132 SMs) no width-per-part cut is BALANCED_MIN_GAIN
    cheaper, so the Hopper plan kernel keeps the one-width cut. Past 32 rows the caps start at min_blocks_per_part:
    without that, b=1 s=4096 h=128 would be cut into 64 one-block parts (slower than 32 of two, planner.py)."""
    from mla_backend.bench import make_configs

    equal = [c for c in make_configs("full") if not c.ragged and not c.spread and not c.long_len]
    assert len(equal) > 40
    for cfg in equal:
        planner = SplitPlanner(cfg.b, cfg.h, cfg.s_q, device="cpu", num_sms=132, block_n=64)
        plan = planner.plan(torch.full((cfg.b,), cfg.s_k, dtype=torch.int32))
        assert hopper_cut(plan, [-(-cfg.s_k // 64)] * cfg.b, SEGMENT_COST_BLOCKS) is None, cfg


def test_balanced_cut_of_one_request_shorter_than_min_blocks():
    """One block at 64 rows (min_blocks 2): the only cut is the whole request in one part, cost 1 + segment_cost."""
    cost, starts = balanced_cut([1], 4, SEGMENT_COST_BLOCKS, min_blocks=2)
    assert cost == 1 + SEGMENT_COST_BLOCKS and starts == [0, 1, 1, 1, 1]
