"""The Hopper kernel's barrier protocol (``kernels/sm90/protocol.py``), simulated on a machine without a GPU.

A simulation of the three roles (12 warps, random interleavings, async cp.async completion) runs the kernel's own
parity functions over random plans and checks that every wait targets the right phase (none passes early, none waits
on a phase that nobody completes: no deadlock), every arrival lands in the phase it is meant for, and no shared buffer
is read while being written or overwritten while read. Deliberately broken protocols must fail it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from mla_backend.kernels.configs import SM90
from mla_backend.kernels.sm90 import protocol as ws

class ProtocolError(AssertionError):
    pass


class Deadlock(AssertionError):
    pass


@dataclass
class MBarrier:
    """An mbarrier: ``completions`` phases done; a wait on parity p passes iff completions % 2 != p."""

    name: str
    expected: int
    pending: int = 0
    completions: int = 0
    tx: int = 0  # transaction bytes still expected in this phase (TMA: expect_tx, then complete_tx)

    def __post_init__(self):
        self.pending = self.expected

    def _check_phase(self, meant_for: int, what: str):
        if meant_for != self.completions:
            raise ProtocolError(f"{self.name}: {what} meant for completion {meant_for} lands in phase "
                                f"{self.completions}")

    def _complete_if_done(self):
        if self.pending == 0 and self.tx == 0:
            self.completions += 1
            self.pending = self.expected

    def arrive(self, threads: int, meant_for: int):
        self._check_phase(meant_for, "arrival")
        self.pending -= threads
        if self.pending < 0:
            raise ProtocolError(f"{self.name}: too many arrivals in phase {self.completions}")
        self._complete_if_done()

    def expect_tx(self, nbytes: int, meant_for: int):
        self._check_phase(meant_for, "expect_tx")
        if self.pending == 0:
            raise ProtocolError(f"{self.name}: expect_tx after the phase's last arrival")
        self.tx += nbytes

    def complete_tx(self, nbytes: int, meant_for: int):
        self._check_phase(meant_for, "complete_tx")
        self.tx -= nbytes
        self._complete_if_done()

    def passes(self, parity: int, waits_for: int) -> bool:
        """``waits_for``: the completion (0-based) the waiter needs; -1 for 'none yet' (fresh barrier)."""
        if parity != (waits_for & 1):
            raise ProtocolError(f"{self.name}: parity {parity} does not name completion {waits_for}")
        if self.completions % 2 == parity:
            if self.completions >= waits_for + 2:
                raise Deadlock(f"{self.name}: completion {waits_for} was overtaken (now {self.completions})")
            return False
        if self.completions != waits_for + 1:
            raise ProtocolError(f"{self.name}: wait for completion {waits_for} passes with {self.completions} "
                                "completions (parity aliasing)")
        return True


@dataclass
class Buffer:
    """Shared tile written in 4 slices (one per warp of the writing warpgroup); tags name the contents.

    Reads are intervals (a WGMMA reads shared memory while it runs): a write may not begin while any
    warp is between its read begin and read end, and a read must see the expected tag throughout.
    """

    name: str
    tags: list = field(default_factory=lambda: ["init"] * 4)
    writing: list = field(default_factory=lambda: [False] * 4)
    readers: int = 0

    def write_begin(self, s):
        if self.readers:
            raise ProtocolError(f"{self.name}[{s}] overwritten while {self.readers} warp(s) read it")
        if self.writing[s]:
            raise ProtocolError(f"{self.name}[{s}] written twice at once")
        self.writing[s] = True
        self.tags[s] = None

    def write_end(self, s, tag):
        self.writing[s] = False
        self.tags[s] = tag

    def check(self, tag):
        if any(self.writing) or self.tags != [tag] * 4:
            raise ProtocolError(f"{self.name} read for {tag!r} holds {self.tags} (writing {self.writing})")

    def read_begin(self, tag):
        self.check(tag)
        self.readers += 1

    def read_end(self, tag):
        self.check(tag)
        self.readers -= 1


def cut_starts(cut, num_parts, total):
    """A plan's part starts ``[num_parts + 1]`` from ``cut``: one width for every part (the torch planner's), or the
    starts themselves (the plan kernel's balanced cut)."""
    return list(cut) if isinstance(cut, (list, tuple)) else [min(p * cut, total) for p in range(num_parts + 1)]


def plan_parts(kv_lens, cut, num_parts, block_n=64):
    """The planner's split (mla_backend.planner.SplitPlanner.plan) for an arbitrary cut (a width, or part starts)."""
    import bisect

    cu = [0]
    for n in kv_lens:
        cu.append(cu[-1] + -(-n // block_n))
    total = cu[-1]
    starts = cut_starts(cut, num_parts, total)
    begin, end = [], []
    for p in range(num_parts):
        lo, hi = starts[p], starts[p + 1]
        b = bisect.bisect_right(cu[1:], lo)
        e = bisect.bisect_right(cu[1:], hi - 1)
        begin.append(b)
        end.append(e if hi > lo else b - 1)
    return cu, begin, end


def part_segments(cu, cut, part, begin, end):
    """The kernel's request loop for one part: (req, blk_lo, blk_hi, g0) of each non-empty segment."""
    starts = cut_starts(cut, len(begin), cu[-1])
    part_lo, part_hi = starts[part], starts[part + 1]
    segs = []
    for req in range(begin[part], end[part] + 1):
        req_lo, req_hi = cu[req], cu[req + 1]
        blk_lo = max(part_lo, req_lo) - req_lo
        blk_hi = min(part_hi, req_hi) - req_lo
        if blk_hi > blk_lo:
            segs.append((req, blk_lo, blk_hi, ws.segment_first_block(part_lo, req_lo, blk_lo)))
    return segs


def simulate_part(segs, *, fp8=False, producers=1, seed=0, mutation=None, max_steps=5_000_000, kv_lens=None,
                  rs_pv=True, tile_ready=False):
    """Runs the 12 warps of one program (``producers`` > 1: tws fp8's producer warpgroups, taking blocks in
    turn) over its segments with a random schedule. ``kv_lens`` (a 16-bit cache with TMA, one length per request):
    a whole block is one TMA copy (warp 0 sets expect_tx and issues it, every warp arrives), a request's partial
    last block stays a cp.async gather.

    The warps follow the kernel's code (same order of waits, arrivals, reads and writes, with the
    kernel's parity functions); what each wait and arrival *should* target is computed here from
    running counts, independently of the kernel's closed forms. cp.async copies complete at random
    later steps, and their noinc arrivals fire after the issuing warp's earlier copies completed.
    ``rs_pv`` (the default kernel): WG0 stores alpha in its slot before it waits for p_free and multiplies its
    P V from registers (reading only the KV buffer); otherwise alpha is part of P's shared tile.
    ``tile_ready`` (16-bit cache, the default beyond 16 rows): each KV buffer is three tiles (left ``l``, right ``r``,
    rope ``t``), filled in that order, each on its own k_ready; WG0 issues S tile by tile as each lands and
    multiplies its P V with the left tile, WG1 waits for the right tile only; k_free stays one per buffer.
    Returns the number of blocks the program processed.
    """
    rng = random.Random(seed)
    tiles = "lrt" if tile_ready else ("",)  # KV buffer kv{b}{tile}, its k_ready{b}{tile}
    bars = {f"k_ready{b}{tile}": MBarrier(f"k_ready[{b}]{tile}", 128) for b in (0, 1) for tile in tiles}
    bars |= {"k_free0": MBarrier("k_free[0]", 256), "k_free1": MBarrier("k_free[1]", 256),
            "q_ready": MBarrier("q_ready", 128), "q_free": MBarrier("q_free", 128),
            "p_ready": MBarrier("p_ready", 128), "p_free": MBarrier("p_free", 128),
            "l_ready": MBarrier("l_ready", 128), "l_free": MBarrier("l_free", 128)}
    bufs = {n: Buffer(n) for n in ("q", "p", "l", "alpha0", "alpha1")}
    bufs |= {f"kv{b}{tile}": Buffer(f"kv{b}{tile}") for b in (0, 1) for tile in tiles}
    v_left, v_right = ("l", "r") if tile_ready else ("", "")  # the tiles WG0's / WG1's P V read

    # independent bookkeeping: each block's running index and the fill number of its buffer
    per_segment = []
    fills = [0, 0]
    run = 0
    tma_block = []  # per running index: a whole block of a TMA kernel
    for s, (req, blk_lo, blk_hi, g0) in enumerate(segs):
        blks = []
        for blk in range(blk_hi - blk_lo):
            g = g0 + blk
            if mutation == "g_restarts_per_request":
                g = blk  # the bug the running counter avoids: phases restart at every request
            b = ws.kv_buffer(g)
            blks.append((blk, g, b, fills[b], run))
            tma_block.append(kv_lens is not None and (blk_lo + blk + 1) * 64 <= kv_lens[req])
            fills[b] += 1
            run += 1
        per_segment.append((s, blks))
    n_blocks = run

    # ops: ("wait", bar, parity, waits_for) ("arrive", bar, meant_for) ("rbegin"|"rend", buf, tag)
    #      ("wbegin", buf, slice) ("wend", buf, slice, tag) ("copy", buf, slice, tag): cp.async
    #      ("noinc", bar, meant_for): cp.async.mbarrier.arrive.noinc
    #      ("sync", group, n): a named barrier of the warpgroup (TileLang's, or a WGMMA's collective issue)
    def wg0(w):
        nsync = 0
        seg = 0  # the kernel's counter of non-empty segments
        for s, blks in per_segment:
            yield ("wait", "q_ready", ws.seg_ready_parity(seg), s)
            for (blk, g, b, fill, r) in blks:
                yield ("rbegin", "q", s)
                for tile in tiles:  # S = Q K^T: one wgmma_gemm per tile (tile_ready: as each lands), wait_wgmma(0)
                    yield ("wait", f"k_ready{b}{tile}", ws.kv_ready_parity(g), fill)
                    nsync += 1
                    yield ("sync", "wg0", nsync)
                    yield ("rbegin", f"kv{b}{tile}", r)
                yield ("rend", "q", s)
                for tile in tiles:
                    yield ("rend", f"kv{b}{tile}", r)
                if blk == len(blks) - 1 and mutation != "no_q_free":
                    yield ("arrive", "q_free", s)
                if rs_pv:
                    slot = 0 if mutation == "one_alpha_slot" else ws.alpha_slot(g)
                    yield ("wbegin", f"alpha{slot}", w)
                    yield ("wend", f"alpha{slot}", w, r)
                    yield ("wait", "p_free", ws.p_free_parity(g), r - 1)
                    yield ("wbegin", "p", w)
                    yield ("wend", "p", w, r)
                    nsync += 1
                    yield ("sync", "wg0", nsync)  # P @ V[:, :256], P from registers: issued, then p_ready
                    yield ("rbegin", f"kv{b}{v_left}", r)
                    yield ("arrive", "p_ready", r)  # after fence.proxy.async
                    yield ("rend", f"kv{b}{v_left}", r)  # wait_wgmma(0)
                else:
                    yield ("wait", "p_free", ws.p_free_parity(g), r - 1)
                    nsync += 1
                    yield ("sync", "wg0", nsync)  # TileLang's barrier before the alpha / P stores
                    yield ("wbegin", "p", w)
                    yield ("wend", "p", w, r)
                    yield ("arrive", "p_ready", r)  # after fence.proxy.async
                    nsync += 1
                    yield ("sync", "wg0", nsync)  # P @ V[:, :256]
                    yield ("rbegin", "p", r)
                    yield ("rbegin", f"kv{b}{v_left}", r)
                    yield ("rend", "p", r)
                    yield ("rend", f"kv{b}{v_left}", r)
                yield ("arrive", f"k_free{b}", fill)
            yield ("wait", "l_free", ws.seg_free_parity(seg), s - 1)
            nsync += 1
            yield ("sync", "wg0", nsync)
            yield ("wbegin", "l", w)
            yield ("wend", "l", w, s)
            yield ("arrive", "l_ready", s)
            seg += 1

    def wg1(w):
        nsync = 0
        seg = 0
        for s, blks in per_segment:
            for (blk, g, b, fill, r) in blks:
                yield ("wait", f"k_ready{b}{v_right}", ws.kv_ready_parity(g), fill)  # (tile_ready: its V tile's)
                yield ("wait", "p_ready", ws.p_ready_parity(g), r)
                if rs_pv:  # alpha from its slot (into registers), then P in the GEMM
                    slot = 0 if mutation == "one_alpha_slot" else ws.alpha_slot(g)
                    yield ("rbegin", f"alpha{slot}", r)
                    yield ("rend", f"alpha{slot}", r)
                if mutation == "wg1_frees_early":
                    yield ("arrive", f"k_free{b}", fill)
                yield ("rbegin", "p", r)  # (without rs_pv: alpha, then) P in the GEMM
                nsync += 1
                yield ("sync", "wg1", nsync)  # P @ V[:, 256:]
                yield ("rbegin", f"kv{b}{v_right}", r)
                yield ("rend", f"kv{b}{v_right}", r)
                yield ("rend", "p", r)
                if mutation != "wg1_no_p_free":
                    yield ("arrive", "p_free", r)
                if mutation != "wg1_frees_early":
                    yield ("arrive", f"k_free{b}", fill)
            yield ("wait", "l_ready", ws.seg_ready_parity(seg), s)
            yield ("rbegin", "l", s)
            yield ("rend", "l", s)
            yield ("arrive", "l_free", s)
            seg += 1

    def producer(pw, w):
        nsync = 0
        seg = 0
        for s, blks in per_segment:
            if pw == 0:  # (rr: producer 0 loads Q)
                yield ("wait", "q_free", ws.seg_free_parity(seg), s - 1)
                yield ("copy", "q", w, s)
                yield ("noinc", "q_ready", s)
            for (blk, g, b, fill, r) in blks:
                if g % producers != (0 if mutation == "rr_same_turn" else pw):
                    continue
                if mutation != "producer_skips_free_wait":
                    yield ("wait", f"k_free{b}", ws.kv_free_parity(g), fill - 1)
                if tile_ready:  # fill_part per tile: its TMA box(es) or gather, on its own k_ready
                    for tile in tiles:
                        if tma_block[r]:
                            if w == 0:
                                yield ("tma", f"kv{b}{tile}", r, f"k_ready{b}{tile}", fill)
                            yield ("arrive", f"k_ready{b}{tile}", fill)
                        else:
                            yield ("copy", f"kv{b}{tile}", w, r)
                            yield ("noinc", f"k_ready{b}{tile}", fill)
                elif tma_block[r]:
                    if w == 0:  # the elected thread: expect_tx, then the nine boxes (one copy here)
                        yield ("tma", f"kv{b}", r, f"k_ready{b}", fill)
                    yield ("arrive", f"k_ready{b}", fill)
                elif producers > 1:  # rr: convert and store (no barrier among the warps), hand over
                    yield ("wbegin", f"kv{b}", w)
                    yield ("wend", f"kv{b}", w, r)
                    yield ("arrive", f"k_ready{b}", fill)  # after fence.proxy.async
                elif fp8:  # load, convert, store; TileLang's named barriers sit between the stores
                    nsync += 1
                    yield ("sync", "producer", nsync)
                    yield ("wbegin", f"kv{b}", w)
                    yield ("wend", f"kv{b}", w, r)
                    yield ("arrive", f"k_ready{b}", fill)  # after fence.proxy.async
                else:
                    yield ("copy", f"kv{b}", w, r)
                    yield ("noinc", f"k_ready{b}", fill)
            seg += 1
        if mutation == "producer_no_tail":
            return
        if producers > 1:  # rr: producer 0 waits for its last Q copies (the kernel's q_ready, segment seg - 1)
            if pw == 0 and seg > 0:
                yield ("wait", "q_ready", ws.seg_ready_parity(seg - 1), seg - 1)
        elif n_blocks:  # the tail: wait for the part's last k_ready phase (the kernel's g = part_hi - part_lo - 1)
            # with TMA blocks also the block before, and with TMA or fp8 blocks the last Q (their phases do not
            # wait for the thread's earlier cp.async)
            # (tile_ready: the last tile's barrier, the kernel's last_copy_barrier)
            last_tile = tiles[0] if mutation == "tail_first_tile" else tiles[-1]
            tma_tail = kv_lens is not None and mutation != "tma_tail_last_only"
            g_last = n_blocks - 1
            if tma_tail and n_blocks > 1:
                b = ws.kv_buffer(g_last - 1)
                yield ("wait", f"k_ready{b}{last_tile}", ws.kv_ready_parity(g_last - 1), fills[b] - 1)
            b = ws.kv_buffer(g_last)
            yield ("wait", f"k_ready{b}{last_tile}", ws.kv_ready_parity(g_last), fills[b] - 1)
            if tma_tail or (fp8 and mutation != "fp8_tail_last_only"):
                yield ("wait", "q_ready", ws.seg_ready_parity(seg - 1), seg - 1)

    warps = [("wg0", w, wg0(w)) for w in range(4)] + [("wg1", w, wg1(w)) for w in range(4)] + \
            [("producer", (pw, w), producer(pw, w)) for pw in range(producers) for w in range(4)]
    run_warps(warps, bars, bufs, rng, max_steps)
    assert bars["p_ready"].completions == n_blocks == bars["p_free"].completions
    for tile in tiles:
        assert bars[f"k_ready0{tile}"].completions + bars[f"k_ready1{tile}"].completions == n_blocks
    assert bars["k_free0"].completions + bars["k_free1"].completions == n_blocks
    assert bars["q_ready"].completions == len(segs) == bars["l_ready"].completions
    return n_blocks


TMA_TILE_BYTES = 64 * 576 * 2  # one whole 16-bit block (the kernel's expect_tx per buffer)


def run_warps(warps, bars, bufs, rng, max_steps):
    """Random schedule of the warps' op generators (``(role, id, generator)``) until all are done; raises
    ProtocolError / Deadlock. cp.async copies complete at random later steps, and a noinc arrival fires once
    the issuing warp's earlier copies have completed."""
    nxt = [next(gen, None) for _, _, gen in warps]
    arrived_at_sync = {}  # (group, n) -> warps that reached that named barrier
    jobs = {}  # id -> (warp, buffer, slice, tag): cp.async in flight
    tma_jobs = {}  # id -> (buffer, tag, barrier, meant_for): a TMA copy of a whole tile in flight
    job_weight = {}  # id -> how likely it completes at a step: some copies are slow (a cache miss, a busy bank)
    noincs = []  # (barrier, meant_for, ids of the warp's copies it waits for)
    next_job = 0
    speed = [rng.choice((0.1, 1.0, 10.0)) for _ in warps]  # skew: some warps run ahead, some lag

    for _ in range(max_steps):
        enabled, weights = [], []
        for i, op in enumerate(nxt):
            if op is None:
                continue
            if op[0] == "wait" and not bars[op[1]].passes(op[2], op[3]):
                continue
            if op[0] == "sync_wait" and arrived_at_sync[(op[1], op[2])] < 4:
                continue
            enabled.append(("warp", i))
            weights.append(speed[i])
        for j in jobs:
            enabled.append(("job", j))
            weights.append(job_weight[j])
        for j in tma_jobs:
            enabled.append(("tma_done", j))
            weights.append(job_weight[j])
        for k, (_, _, deps) in enumerate(noincs):
            if not deps & jobs.keys():
                enabled.append(("noinc", k))
                weights.append(1.0)
        if not enabled:
            if all(op is None for op in nxt):
                break
            state = [f"{warps[i][0]}.{warps[i][1]}: {op}" for i, op in enumerate(nxt) if op is not None]
            raise Deadlock("no warp can move: " + "; ".join(state) + " | completions " +
                           ", ".join(f"{b.name}={b.completions}" for b in bars.values()))
        what, i = rng.choices(enabled, weights=weights)[0]
        if what == "job":
            _, buf, sl, tag = jobs.pop(i)
            bufs[buf].write_end(sl, tag)
            continue
        if what == "noinc":
            bar, meant_for, _ = noincs.pop(i)
            bars[bar].arrive(32, meant_for)
            continue
        if what == "tma_done":
            buf, tag, bar, meant_for = tma_jobs.pop(i)
            for sl in range(4):
                bufs[buf].write_end(sl, tag)
            bars[bar].complete_tx(TMA_TILE_BYTES, meant_for)
            continue
        op = nxt[i]
        kind = op[0]
        if kind == "arrive":
            bars[op[1]].arrive(32, op[2])
        elif kind == "rbegin":
            bufs[op[1]].read_begin(op[2])
        elif kind == "rend":
            bufs[op[1]].read_end(op[2])
        elif kind == "wbegin":
            bufs[op[1]].write_begin(op[2])
        elif kind == "wend":
            bufs[op[1]].write_end(op[2], op[3])
        elif kind == "copy":
            bufs[op[1]].write_begin(op[2])
            jobs[next_job] = (i, op[1], op[2], op[3])
            job_weight[next_job] = rng.choice((1.0, 1.0, 0.01))
            next_job += 1
        elif kind == "noinc":
            noincs.append((op[1], op[2], {j for j, job in jobs.items() if job[0] == i}))
        elif kind == "tma":  # ("tma", buffer, tag, barrier, meant_for): expect_tx, then the copy
            bars[op[3]].expect_tx(TMA_TILE_BYTES, op[4])
            for sl in range(4):
                bufs[op[1]].write_begin(sl)
            tma_jobs[next_job] = (op[1], op[2], op[3], op[4])
            job_weight[next_job] = rng.choice((1.0, 1.0, 0.01))
            next_job += 1
        elif kind == "sync":
            key = (op[1], op[2])
            arrived_at_sync[key] = arrived_at_sync.get(key, 0) + 1
            nxt[i] = ("sync_wait", op[1], op[2])
            continue
        nxt[i] = next(warps[i][2], None)
        if nxt[i] is None and warps[i][0] == "producer" and any(job[0] == i for job in jobs.values()):
            raise ProtocolError(f"producer warp {warps[i][1]} exits with cp.async in flight")
    else:
        raise AssertionError("simulation did not finish")

    assert not jobs and not noincs and not tma_jobs
    for b in bars.values():
        assert b.pending == b.expected, f"{b.name}: {b.expected - b.pending} stray arrivals left at the end"
    assert all(buf.readers == 0 for buf in bufs.values())


def test_protocol_parities_match_the_running_counts():
    """The closed forms the kernel uses, against counting."""
    for g in range(64):
        fill = g // 2  # buffer g & 1 alternates, so this is block g's fill number of its buffer
        assert ws.kv_buffer(g) == g % 2
        assert ws.kv_ready_parity(g) == fill % 2
        assert ws.kv_free_parity(g) == (fill - 1) % 2
        assert ws.p_ready_parity(g) == g % 2
        assert ws.p_free_parity(g) == (g - 1) % 2
        assert ws.seg_ready_parity(g) == g % 2 and ws.seg_free_parity(g) == (g - 1) % 2


def test_segments_number_blocks_contiguously():
    """g runs 0, 1, ... through every part whatever the request boundaries, and the parts cover every
    flat block exactly once: the phase counters never restart or skip."""
    rng = random.Random(1)
    for _ in range(300):
        lens = [rng.choice((0, 0, 1, 63, 64, 65, 128, 200, 1000, rng.randrange(1, 3000))) for _ in range(rng.randrange(1, 12))]
        total = sum(-(-n // 64) for n in lens)
        num_parts = rng.randrange(1, 9)
        width = max(1, -(-total // num_parts), rng.choice((1, 4)))
        cu, begin, end = plan_parts(lens, width, num_parts)
        seen = []
        for part in range(num_parts):
            segs = part_segments(cu, width, part, begin, end)
            gs = [g0 + k for (_, lo, hi, g0) in segs for k in range(hi - lo)]
            assert gs == list(range(len(gs)))
            seen += [cu[req] + lo + k for (req, lo, hi, _) in segs for k in range(hi - lo)]
        assert sorted(seen) == list(range(total))


EDGE_CASES = {
    # kv_lens, width, num_parts
    "one-block": ([5], 4, 1),
    "odd-blocks": ([64 * 3], 4, 1),
    "odd-then-odd": ([64 * 3, 64 * 5 - 7], 16, 1),
    "empty-request-between": ([64 * 3, 0, 0, 64 * 2 + 1, 0], 16, 1),
    "many-short-requests": ([1, 64, 65, 3, 130, 7, 0, 64], 4, 3),
    "width-1": ([64 * 3, 64, 1], 1, 5),
    "request-spans-parts": ([64 * 11], 4, 3),
    "empty-part": ([64], 4, 3),
}


@pytest.mark.parametrize("fp8,producers", [(False, 1), (True, 1), (True, 2)],
                         ids=["cp.async", "fp8-registers", "fp8-2-producers"])
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_protocol_edge_cases(case, fp8, producers):
    lens, width, num_parts = EDGE_CASES[case]
    cu, begin, end = plan_parts(lens, width, num_parts)
    for part in range(num_parts):
        segs = part_segments(cu, width, part, begin, end)
        for seed in range(20):
            # tws fp8 (the producers > 1 variant) has transposed consumers: no rs_pv there
            simulate_part(segs, fp8=fp8, producers=producers, seed=seed, rs_pv=producers == 1 and seed % 2 == 0)


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_protocol_edge_cases_tma(case):
    """16-bit cache, page size >= 64: whole blocks by TMA, partial last blocks by cp.async, in one part."""
    lens, width, num_parts = EDGE_CASES[case]
    cu, begin, end = plan_parts(lens, width, num_parts)
    for part in range(num_parts):
        segs = part_segments(cu, width, part, begin, end)
        for seed in range(20):
            simulate_part(segs, seed=seed, kv_lens=lens, tile_ready=seed % 2 == 0)


def test_protocol_three_producers_alias_k_free():
    """Why tws fp8 has at most 2 producer warpgroups: with 3 taking blocks in turn over 2 buffers, a producer
    can wait for k_free's completion f - 1 while it is at f - 3 (its earlier fills of that buffer were another
    producer's), and a parity wait cannot tell them apart."""
    lens, width, num_parts = EDGE_CASES["odd-then-odd"]
    cu, begin, end = plan_parts(lens, width, num_parts)
    segs = part_segments(cu, width, 0, begin, end)
    failures = 0
    for seed in range(20):
        try:
            simulate_part(segs, fp8=True, producers=3, seed=seed)
        except ProtocolError:
            failures += 1
    assert failures, "3 producers never aliased"
    assert ws.TWS_FP8_PRODUCERS in (1, 2)


def random_plans(seed: int, trials: int):
    """``(trial, lens, part, segments)`` of every part of ``trials`` random plans: ragged lengths around the 64-token
    block edges, 1-5 parts, blocks per part from 1 up."""
    rng = random.Random(seed)
    for trial in range(trials):
        lens = [rng.choice((0, 1, 64, 65, 127, 128, 129, rng.randrange(1, 1500))) for _ in range(rng.randrange(1, 10))]
        total = sum(-(-n // 64) for n in lens)
        num_parts = rng.randrange(1, 6)
        width = max(rng.choice((1, 2, 3, 4)), -(-total // num_parts))
        cu, begin, end = plan_parts(lens, width, num_parts)
        for part in range(num_parts):
            yield trial, lens, part, part_segments(cu, width, part, begin, end)


def test_protocol_random_plans():
    runs = 0
    for trial, lens, part, segs in random_plans(2024, 150):
        simulate_part(segs, fp8=trial % 3 != 1, producers=1 + (trial % 3 == 2), seed=trial * 31 + part,
                      rs_pv=trial % 3 != 2 and trial % 2 == 0)
        if trial % 3 == 1:  # the 16-bit cache's kernel, also with TMA blocks, per-tile k_ready or not
            simulate_part(segs, seed=trial * 31 + part, kv_lens=lens, rs_pv=trial % 2 == 1,
                          tile_ready=trial % 4 != 1)
            simulate_part(segs, seed=trial * 37 + part, tile_ready=True)  # gathers only
        runs += 1
    assert runs > 150


def test_protocol_with_the_real_planner():
    """Plans made by mla_backend.planner.SplitPlanner with 64-token blocks (the kernel's block size), and every other
    trial the plan kernel's balanced cut (a width per part) of the same batch."""
    torch = pytest.importorskip("torch")
    from mla_backend.planner import SEGMENT_COST_BLOCKS, SplitPlanner, balanced_cut

    rng = random.Random(7)
    for trial in range(20):
        batch = rng.randrange(1, 9)
        lens = [rng.choice((0, 1, 64, 100, rng.randrange(1, 4000))) for _ in range(batch)]
        planner = SplitPlanner(batch, 16, 1, "cpu", num_sms=rng.choice((4, 8, 16)), block_n=SM90.block_n)
        plan = planner.plan(torch.tensor(lens, dtype=torch.int32))
        cu = plan.cu_blocks[: batch + 1].tolist()
        starts = plan.part_start.tolist()
        begin, end = plan.part_begin_req.tolist(), plan.part_end_req.tolist()
        assert (cu, begin, end) == plan_parts(lens, starts, plan.num_parts)
        if trial % 2:
            blocks = [b - a for a, b in zip(cu, cu[1:])]
            starts = balanced_cut(blocks, plan.num_parts, SEGMENT_COST_BLOCKS)[1]
            cu, begin, end = plan_parts(lens, starts, plan.num_parts)
        for part in range(plan.num_parts):
            producers = ws.TWS_FP8_PRODUCERS if trial % 4 == 1 else 1
            simulate_part(part_segments(cu, starts, part, begin, end), seed=trial, fp8=trial % 2 == 1,
                          producers=producers, kv_lens=lens if trial % 4 == 2 else None, rs_pv=producers == 1,
                          tile_ready=trial % 4 in (0, 2))


@pytest.mark.parametrize("mutation,error", [
    ("g_restarts_per_request", (ProtocolError, Deadlock)),
    ("no_q_free", Deadlock),
    ("wg1_no_p_free", Deadlock),
    ("producer_skips_free_wait", ProtocolError),
    ("producer_no_tail", ProtocolError),
    ("rr_same_turn", (ProtocolError, Deadlock)),
    ("tma_tail_last_only", ProtocolError),
    ("fp8_tail_last_only", ProtocolError),
    ("one_alpha_slot", ProtocolError),
    ("wg1_frees_early", ProtocolError),
    ("tile_tail_first_tile", ProtocolError),
    ("tile_tma_tail_last_only", ProtocolError),
])
def test_protocol_simulation_catches_broken_protocols(mutation, error):
    """The simulation has teeth: each of these bugs is caught on some plan and schedule."""
    lens, width, num_parts = [64 * 3, 0, 64 * 2 + 1, 64 * 3], 16, 1
    if mutation.endswith("_tail_last_only"):  # a gather (a partial last block), then a one-block last segment
        lens = [64 * 2 + 1, 64]
    cu, begin, end = plan_parts(lens, width, num_parts)
    segs = part_segments(cu, width, 0, begin, end)
    producers = 2 if mutation.startswith("rr_") else 1
    tile_ready = mutation.startswith("tile_")
    mutation = mutation.removeprefix("tile_")
    caught = 0
    for seed in range(30):
        try:
            simulate_part(segs, seed=seed, mutation=mutation, fp8=producers > 1 or mutation.startswith("fp8_"),
                          producers=producers, tile_ready=tile_ready,
                          kv_lens=lens if mutation.startswith("tma_") else None)
        except error:
            caught += 1
    assert caught > 0, f"{mutation} went unnoticed in 30 schedules"


def test_tile_barriers_are_the_kernel_indices():
    """part_barrier (tile_ready): buffer-major, three tiles each."""
    assert (ws.PART_T, ws.PART_L, ws.PART_R) == (0, 1, 2) and ws.N_PARTS == 3
    assert [ws.part_barrier(g, p) for g in (4, 7) for p in range(3)] == [0, 1, 2, 3, 4, 5]
