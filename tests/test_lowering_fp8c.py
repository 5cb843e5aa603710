"""The fp8-compute ws kernel (``kernels/sm90/fp8c.py``, ``KernelConfig.fp8_compute``), on a machine without a GPU.

* Which variants take it: an fp8 cache, ``fp8_compute`` on, and h x q_len > 16 (the ws rows); everything else builds
  the kernel it builds without the switch.
* Its barrier protocol, simulated with tests/test_lowering_ws_protocol.py's machinery: K8 read by S and by both
  consumers' P V (k_free after both), the alpha slot and l / m read back per O^T column, P8 read by both P Vs.
* TileLang lowers it for ``sm_90a`` (e4m3 WGMMA for S, the inline RS e4m3 WGMMA for P V, the budgets' registers and
  shared memory, role-local named barriers), and nvcc compiles one variant without serialised WGMMAs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import random
import re
import subprocess

import pytest
from toolchain import find_nvcc

if os.environ.get("CI"):
    import tilelang  # noqa: F401  (in CI a broken TileLang install must fail, not skip)
else:
    pytest.importorskip("tilelang")

from test_lowering_ws import _lower, check_named_barriers_role_local, named_barriers  # noqa: E402
from test_lowering_ws_protocol import (EDGE_CASES, Buffer, Deadlock, MBarrier, ProtocolError,  # noqa: E402
                                       part_segments, plan_parts, random_plans, run_warps)

from mla_backend.kernels import configs, sm90  # noqa: E402
from mla_backend.kernels.sm90 import protocol as ws  # noqa: E402
from mla_backend.kernels.sm90.fp8c import fp8c_prelude  # noqa: E402

FP8C = configs.SM90_FP8_COMPUTE
SM90_SMEM_LIMIT = 232448

# (num_heads, q_len, page_size, dtype, kv_dtype)
LOWER_VARIANTS = [
    (128, 1, 64, "bfloat16", "float8_e4m3"),  # TP1 decode, 2 row blocks, whole blocks by TMA; also nvcc-compiled
    (32, 2, 16, "float16", "float8_e4m3"),  # MTP, one row block, cp.async gather, fp16 q and output
    (32, 1, 1, "bfloat16", "float8_e4m3"),  # a padded row block (32 of 64 rows), page size 1
]


def _vid(v) -> str:
    return "-".join(str(x) for x in v)


# ============================================================================ which variants
def test_fp8c_block_trace_is_off_by_default_and_records_every_role():
    """KernelConfig.trace_part (scripts/trace_blocks.py --fp8c): no trace code in the shipped kernel; traced, each
    role stamps its steps (scripts/trace_blocks.py's FP8C_STEPS: WG0 7, WG1 4, the producer 3) and its segment stamps
    (protocol.SEG_TRACE_STEP: WG0 and WG1 one, the producer three), and ends its record."""
    variant = LOWER_VARIANTS[0]
    plain = sm90.build_decode_kernel(*variant, cfg=FP8C).script()
    traced = sm90.build_decode_kernel(*variant, cfg=dataclasses.replace(FP8C, trace_part=3)).script()
    assert "mla_trace" not in plain and '"mla_trace_begin"' in traced
    stamps = re.findall(r'"mla_trace", (\d), \w+, (\d)\)', traced)
    seg = ws.SEG_TRACE_STEP
    assert sorted({(int(r), int(k)) for r, k in stamps}) == sorted(
        [(0, k) for k in [*range(7), seg]] + [(1, k) for k in [*range(4), seg]] + [(2, k) for k in [0, 1, 2, seg - 2,
                                                                                                  seg - 1, seg]])
    assert all(f'"mla_trace_end", {role})' in traced for role in range(3))


def test_fp8c_only_with_fp8_compute_beyond_16_rows():
    """The fp8c kernel is the ws kernel of an fp8 cache with fp8_compute on: rows <= 16 keep the tws kernel, a 16-bit
    cache ignores the switch, and the shipped configs leave it off."""
    assert not configs.SM90.fp8_compute and not any(cfg.fp8_compute for cfg in configs.CONFIGS.values())
    for (heads, q_len), expected in [((128, 1), True), ((16, 2), True), ((17, 1), True), ((32, 1), True),
                                     ((16, 1), False), ((8, 2), False), ((5, 2), False)]:
        spec = sm90.variant_spec(heads, q_len, 64, "bfloat16", "float8_e4m3", FP8C)
        assert spec.fp8c is expected and spec.transposed is not expected, (heads, q_len)
        assert not sm90.variant_spec(heads, q_len, 64, "bfloat16", "float8_e4m3").fp8c
        assert not sm90.variant_spec(heads, q_len, 64, "bfloat16", "bfloat16", FP8C).fp8c
    spec = sm90.variant_spec(128, 1, 64, "bfloat16", "float8_e4m3", FP8C)
    assert spec.cdtype == "float8_e4m3" and not spec.q_to_f16 and spec.threads == 384
    assert (spec.regs_wg0, spec.regs_wg1, spec.regs_producer) == ws.REGS_FP8C


@pytest.mark.parametrize("variant", [(16, 1, 64, "bfloat16", "float8_e4m3"), (8, 2, 1, "float16", "float8_e4m3"),
                                     (128, 1, 64, "bfloat16", "bfloat16"), (32, 2, 16, "float16", "float16")],
                         ids=_vid)
def test_fp8_compute_changes_nothing_it_does_not_take(variant):
    """Where the fp8c kernel is not taken (tws rows, a 16-bit cache), fp8_compute builds the very same prim_func."""
    assert sm90.build_decode_kernel(*variant, cfg=FP8C).script() == \
        sm90.build_decode_kernel(*variant, cfg=configs.SM90).script()


def test_fp8_compute_off_keeps_the_converting_fp8_kernel():
    """fp8_compute off (the default), an fp8 ws variant converts the cache to fp16 as before: no fp8c helper in its
    program, and none in the prelude every non-fp8c kernel carries (fp8c.cuh is pasted into the fp8c kernel only,
    so the other kernels' CUDA, and their cache keys, do not change)."""
    script = sm90.build_decode_kernel(128, 1, 64, "bfloat16", "float8_e4m3", cfg=configs.SM90).script()
    assert "mla_e4m3x16_store" in script and "float16" in script
    fp8c_script = sm90.build_decode_kernel(128, 1, 64, "bfloat16", "float8_e4m3", cfg=FP8C).script()
    helpers = set(re.findall(r"__device__ __forceinline__ \w+ (mla_\w+)\(", fp8c_prelude()))
    assert {"mla_pv8_vt", "mla_p8_store_ldsm", "mla_q8_inv_scale", "mla_ot_store"} <= helpers
    for name in helpers:
        assert name not in ws.PRELUDE and name not in script, name
    assert "mla_pv8_vt" in fp8c_script and "mla_e4m3x16_store" not in fp8c_script


def test_fp8c_budgets_fit():
    """setmaxnreg multiples of 8 within the 3 x 168 registers of a 384-thread slot (WG0 up, WG1 at the launch count,
    the producer down), and the shared memory of fp8c.py's table within the 227 KiB a CTA may use."""
    wg0, wg1, producer = ws.register_budget(True, fp8c=True)
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in (wg0, wg1, producer))
    assert wg0 + wg1 + producer <= ws.REGS_PER_CTA_SLOT
    assert [ws.grows(r) for r in (wg0, wg1, producer)] == [1, 1, 0]
    budget = ws.smem_budget(fp8c=True)
    assert budget["dynamic"] == 36864 + 73728 + 4096 + 3 * 256 + 256 == 115712
    assert budget["total"] <= SM90_SMEM_LIMIT


# ============================================================================ barrier protocol
def simulate_fp8c_part(segs, *, seed=0, mutation=None, kv_lens=None, max_steps=5_000_000):
    """The 12 warps of one fp8c program over its segments, random schedule (test_lowering_ws_protocol's
    ``simulate_part`` and ``run_warps``, with fp8c's order of waits, arrivals, reads and writes; what each wait and
    arrival should target comes from running counts). ``kv_lens``: whole blocks by TMA (page 64), else gathers.

    Producer: a segment's first block, Q8 by plain stores (after q_free), q_ready; per block the next block's copy
    (after k_free), then a wait for this block's own copies. WG0: S (Q8, K8); after p_free the alpha slot and P8 by
    plain stores, its named barrier, p_ready, then its P V reads the alpha slot, P8 and K8; k_free. At a segment's end
    l (and m) after l_free, l_ready, its named barrier, then its columns read back. WG1: after p_ready and k_ready the
    alpha slot, P8 and K8 in its P V; p_free, k_free; at a segment's end l read between l_ready and l_free. WGMMA
    issues are warpgroup-collective (a sync of the 4 warps)."""
    rng = random.Random(seed)
    bars = {"k_ready0": MBarrier("k_ready[0]", 128), "k_ready1": MBarrier("k_ready[1]", 128),
            "k_free0": MBarrier("k_free[0]", 256), "k_free1": MBarrier("k_free[1]", 256),
            "q_ready": MBarrier("q_ready", 128), "q_free": MBarrier("q_free", 128),
            "p_ready": MBarrier("p_ready", 128), "p_free": MBarrier("p_free", 128),
            "l_ready": MBarrier("l_ready", 128), "l_free": MBarrier("l_free", 128)}
    bufs = {n: Buffer(n) for n in ("q", "p", "l", "alpha0", "alpha1", "kv0", "kv1")}
    per_segment, fills, run, tma_block = [], [0, 0], 0, []
    for s, (req, blk_lo, blk_hi, g0) in enumerate(segs):
        blks = []
        for blk in range(blk_hi - blk_lo):
            g = g0 + blk
            b = ws.kv_buffer(g)
            blks.append((blk, g, b, fills[b], run))
            tma_block.append(kv_lens is not None and (blk_lo + blk + 1) * 64 <= kv_lens[req])
            fills[b] += 1
            run += 1
        per_segment.append((s, blks))
    n_blocks = run

    def slot(g):
        return f"alpha{ws.alpha_slot(g)}"

    def wg0(w):
        nsync = 0
        seg = 0
        for s, blks in per_segment:
            yield ("wait", "q_ready", ws.seg_ready_parity(seg), s)
            yield ("rbegin", "q", s)  # the rows' scales (qscale)
            yield ("rend", "q", s)
            for (blk, g, b, fill, r) in blks:
                yield ("wait", f"k_ready{b}", ws.kv_ready_parity(g), fill)
                nsync += 1
                yield ("sync", "wg0", nsync)  # S = Q8 K8^T
                yield ("rbegin", "q", s)
                yield ("rbegin", f"kv{b}", r)
                yield ("rend", "q", s)
                yield ("rend", f"kv{b}", r)
                if mutation == "k_free_after_s":
                    yield ("arrive", f"k_free{b}", fill)
                if blk == len(blks) - 1:
                    yield ("arrive", "q_free", s)
                yield ("wait", "p_free", ws.p_free_parity(g), r - 1)
                yield ("wbegin", slot(g), w)
                yield ("wend", slot(g), w, r)
                yield ("wbegin", "p", w)
                yield ("wend", "p", w, r)
                if mutation != "no_p8_barrier":
                    nsync += 1
                    yield ("sync", "wg0", nsync)  # WG0's named barrier (after the proxy fence)
                yield ("arrive", "p_ready", r)
                yield ("rbegin", slot(g), r)  # mla_ot_scale_alpha, before the WGMMAs
                yield ("rend", slot(g), r)
                nsync += 1
                yield ("sync", "wg0", nsync)  # P V: V^T fragments from K8, P8 as B
                yield ("rbegin", "p", r)
                yield ("rbegin", f"kv{b}", r)
                yield ("rend", "p", r)
                yield ("rend", f"kv{b}", r)
                if mutation != "k_free_after_s":
                    yield ("arrive", f"k_free{b}", fill)
            yield ("wait", "l_free", ws.seg_free_parity(seg), s - 1)
            yield ("wbegin", "l", w)
            yield ("wend", "l", w, s)
            yield ("arrive", "l_ready", s)
            nsync += 1
            yield ("sync", "wg0", nsync)  # its named barrier, then its columns of l (and m)
            yield ("rbegin", "l", s)
            yield ("rend", "l", s)
            seg += 1

    def wg1(w):
        nsync = 0
        seg = 0
        for s, blks in per_segment:
            for (blk, g, b, fill, r) in blks:
                yield ("wait", "p_ready", ws.p_ready_parity(g), r)
                yield ("wait", f"k_ready{b}", ws.kv_ready_parity(g), fill)
                yield ("rbegin", slot(g), r)
                yield ("rend", slot(g), r)
                nsync += 1
                yield ("sync", "wg1", nsync)
                yield ("rbegin", "p", r)
                yield ("rbegin", f"kv{b}", r)
                yield ("rend", "p", r)
                yield ("rend", f"kv{b}", r)
                if mutation != "wg1_no_p_free":
                    yield ("arrive", "p_free", r)
                yield ("arrive", f"k_free{b}", fill)
            yield ("wait", "l_ready", ws.seg_ready_parity(seg), s)
            if mutation == "wg1_reads_l_after_l_free":
                yield ("arrive", "l_free", s)
            yield ("rbegin", "l", s)
            yield ("rend", "l", s)
            if mutation != "wg1_reads_l_after_l_free":
                yield ("arrive", "l_free", s)
            seg += 1

    def fill_block(w, g, b, fill, r):
        yield ("wait", f"k_free{b}", ws.kv_free_parity(g), fill - 1)
        if tma_block[r]:
            if w == 0:  # the elected thread: expect_tx, then the three tiles (one copy here)
                yield ("tma", f"kv{b}", r, f"k_ready{b}", fill)
            yield ("arrive", f"k_ready{b}", fill)
        else:
            yield ("copy", f"kv{b}", w, r)
            yield ("noinc", f"k_ready{b}", fill)

    def producer(w):
        seg = 0
        for s, blks in per_segment:
            yield from fill_block(w, *blks[0][1:])
            yield ("wait", "q_free", ws.seg_free_parity(seg), s - 1)
            yield ("wbegin", "q", w)
            yield ("wend", "q", w, s)
            yield ("arrive", "q_ready", s)  # after fence.proxy.async
            for i, (blk, g, b, fill, r) in enumerate(blks):
                if i + 1 < len(blks):
                    yield from fill_block(w, *blks[i + 1][1:])
                if mutation != "producer_no_own_wait":
                    yield ("wait", f"k_ready{b}", ws.kv_ready_parity(g), fill)
            seg += 1

    warps = [("wg0", w, wg0(w)) for w in range(4)] + [("wg1", w, wg1(w)) for w in range(4)] + \
            [("producer", w, producer(w)) for w in range(4)]
    run_warps(warps, bars, bufs, rng, max_steps)
    assert bars["p_ready"].completions == n_blocks == bars["p_free"].completions
    assert bars["k_ready0"].completions + bars["k_ready1"].completions == n_blocks
    assert bars["k_free0"].completions + bars["k_free1"].completions == n_blocks
    assert bars["q_ready"].completions == len(segs) == bars["l_ready"].completions
    return n_blocks


@pytest.mark.parametrize("tma", [False, True], ids=["gather", "tma"])
@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_fp8c_protocol_edge_cases(case, tma):
    lens, width, num_parts = EDGE_CASES[case]
    cu, begin, end = plan_parts(lens, width, num_parts)
    for part in range(num_parts):
        segs = part_segments(cu, width, part, begin, end)
        for seed in range(20):
            simulate_fp8c_part(segs, seed=seed, kv_lens=lens if tma else None)


def test_fp8c_protocol_random_plans():
    blocks = 0
    for trial, lens, part, segs in random_plans(2025, 120):
        blocks += simulate_fp8c_part(segs, seed=trial * 31 + part, kv_lens=lens if trial % 2 else None)
    assert blocks > 1000


@pytest.mark.parametrize("mutation,error", [
    ("k_free_after_s", ProtocolError),  # K8 is read by both P Vs too, not by S alone
    ("no_p8_barrier", ProtocolError),  # WG0 reads its own alpha slot before every warp has stored its rows
    ("wg1_reads_l_after_l_free", ProtocolError),
    ("wg1_no_p_free", Deadlock),
    ("producer_no_own_wait", ProtocolError),  # a producer warp exits with cp.async in flight
])
def test_fp8c_protocol_simulation_catches_broken_protocols(mutation, error):
    """The simulation has teeth: each of these bugs is caught on some schedule."""
    # a one-block segment: WG0 can then reach the next l store while WG1 is still at the previous l
    lens, width, num_parts = [64 * 3, 0, 64 * 2 + 1, 64, 64 * 3], 16, 1
    cu, begin, end = plan_parts(lens, width, num_parts)
    segs = part_segments(cu, width, 0, begin, end)
    caught = 0
    for seed in range(40):
        try:
            simulate_fp8c_part(segs, seed=seed, mutation=mutation)
        except error:
            caught += 1
    assert caught > 0, f"{mutation} went unnoticed in 40 schedules"


# ============================================================================ lowering + nvcc
@pytest.fixture(scope="module")
def lowered_fp8c():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        results = list(pool.map(functools.partial(_lower, fp8_compute=True), LOWER_VARIANTS))
    return dict(zip(LOWER_VARIANTS, results))


# each role's setmaxnreg call (its branch starts with it): WG0 and WG1 up from the launch's 168, the producer down
ROLE_MARKS = {role: f"warpgroup_reg_{'alloc' if ws.grows(regs) else 'dealloc'}<{regs}>"
              for role, regs in zip(("wg0", "wg1", "producer"), ws.REGS_FP8C)}


@pytest.mark.parametrize("variant", LOWER_VARIANTS, ids=_vid)
def test_fp8c_kernel_lowers(lowered_fp8c, variant):
    """S as TileLang's e4m3 WGMMA (m64n64k32, three tiles, two buffers), P V as fp8c.cuh's RS e4m3 WGMMA in both
    consumers, P8 stored by WG0 in the ldmatrix order, Q quantised by the producer; the budgets' registers and
    shared memory; named barriers role-local, none in the producer's block loop; TMA only for whole pages of 64."""
    src, smem = lowered_fp8c[variant]
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(384, 1\) mla_decode_split_kernel', src)
    shapes = re.findall(r"tl::wgmma_ss<tl::DataType::(\w+), tl::DataType::(\w+), tl::DataType::kFloat32, "
                        r"(\d+), (\d+), (\d+),", src)
    assert shapes == [("kFloat8_e4m3", "kFloat8_e4m3", "64", "64", "32")] * 6, shapes
    assert "tl::wgmma_rs<" not in src
    assert "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3" in src  # fp8c.cuh's P V
    sections = check_named_barriers_role_local(src, variant, ROLE_MARKS)
    assert sections["wg0"].count("mla_pv8_vt(") == 2 and sections["wg1"].count("mla_pv8_vt(") == 2
    assert "mla_p8_store_ldsm(acc_s" in sections["wg0"] and "tl::wgmma_ss<" not in sections["wg1"]
    assert "mla_q8_inv_scale<" in sections["producer"] and "mla_q8_store8<" in sections["producer"]
    assert smem == ws.smem_budget(fp8c=True)["dynamic"], f"dynamic shared memory {smem} B"
    assert smem + ws.smem_budget(fp8c=True)["static"] <= SM90_SMEM_LIMIT
    # 8 for the pipeline (k_ready, k_free: 2 each)
    assert len(re.findall(r"\b(uint64_t) \w+_mem\[", src)) == 8
    assert "k_free[0].init(256);" in src and "k_ready[0].init(128);" in src
    # TileLang puts a named barrier of the producer's warps before and after a segment's Q8 stores (once per segment),
    # none in its block loop, whose copies each thread issues and waits for on its own
    producer_loop = sections["producer"][sections["producer"].index("for (int blk_"):]
    assert not list(named_barriers(producer_loop)), "named barrier in the producer's block loop"
    whole_pages = variant[2] % 64 == 0
    assert ("tl::tma_load(kv_cache_desc" in sections["producer"]) is whole_pages
    assert "cp_async_gs" in sections["producer"] and "cluster_sync" not in src


def test_nvcc_compiles_fp8c_for_sm90a(lowered_fp8c, tmp_path):
    """nvcc + ptxas (-c, warnings on): within the launch's 168 registers, no WGMMA serialised for lack of registers
    (ptxas C7512, which would slow every WGMMA of the kernel), no stack and no spills (TileLang 0.1.9 to 0.1.15), both
    e4m3 WGMMA forms in the PTX."""
    nvcc = find_nvcc()
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    src, _ = lowered_fp8c[LOWER_VARIANTS[0]]
    cu = tmp_path / "fp8c.cu"
    cu.write_text(src)
    keep = tmp_path / "keep"
    keep.mkdir()
    cmd = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--use_fast_math", "-Xptxas", "-v",
           "-keep", f"-keep-dir={keep}", f"-I{TILELANG_TEMPLATE_PATH}", f"-I{CUTLASS_INCLUDE_DIR}", "-c", str(cu),
           "-o", str(tmp_path / "fp8c.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    report = proc.stderr
    assert "C7512" not in report and "serialized" not in report, report[-4000:]
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert regs and spills, report
    assert int(regs.group(1)) <= ws.launch_regs(384), report
    assert max(int(x) for x in spills.groups()) == 0, spills.group(0)
    ptx = "".join(p.read_text() for p in keep.glob("*.ptx"))
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3") >= 2
    for regs, direction in zip(ws.REGS_FP8C, ("inc", "inc", "dec")):
        assert f"setmaxnreg.{direction}.sync.aligned.u32 {regs}" in ptx
