"""The warp-specialised Hopper kernel (``mla_decode_ws``): lowering, nvcc, and its barrier protocol.

Three kinds of checks, all on a machine without a GPU:

* TileLang lowers the kernel for ``sm_90a`` (a few variants: 16 / 128 heads, q_len 1 / 2, page sizes
  1 / 16 / 64, bf16 / fp16, fp8 cache); the generated CUDA has WGMMA, ``setmaxnreg``, exactly the
  shared memory of the budget (so TileLang aliased no buffer between roles), and no CTA-wide or
  role-divergent named barrier after the warp-role split (either would hang).
* nvcc + ptxas compile one variant for sm_90a: no spills; the PTX has ``wgmma.mma_async``; with a
  ``cuobjdump`` at hand, each warpgroup role's SASS stays under its ``setmaxnreg`` budget.
* A simulation of the three roles (12 warps, random interleavings, async cp.async completion) runs the
  kernel's own parity functions over random plans and checks that every wait targets the right phase
  (none passes early, none waits on a phase that nobody completes: no deadlock), every arrival lands in
  the phase it is meant for, and no shared buffer is read while being written or overwritten while read.
  Deliberately broken protocols must fail it.

Each lowering takes ~20-35 s on 2 cores; the variants are lowered in 2 processes once per session.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import multiprocessing
import os
import random
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import pytest
from toolchain import find_nvcc, kernel_body

if os.environ.get("CI"):
    import tilelang  # noqa: F401  (in CI a broken TileLang install must fail, not skip)
else:
    pytest.importorskip("tilelang")

from mla_backend.kernels import mla_decode_ws as ws  # noqa: E402  (imports tilelang.language)
from mla_backend.kernels.configs import compat_pass_configs  # noqa: E402

SM90_SMEM_LIMIT = 232448  # 227 KiB: static + dynamic shared memory one block may use on H100 / H200
# dict form: TileLang >= 0.1.11 rejects the "cuda -arch=sm_90a" string; 0.1.9 takes both
CUDA = {"kind": "cuda", "arch": "sm_90a"}

# (num_heads, q_len, page_size, dtype, kv_dtype)
LOWER_VARIANTS = [
    (128, 1, 64, "bfloat16", "bfloat16"),  # TP1, compute-bound; also nvcc-compiled
    (16, 2, 16, "float16", "float16"),  # TP8, MTP, padded row block (32 of 64 rows)
    (128, 2, 1, "bfloat16", "bfloat16"),  # SGLang page size 1, 4 row blocks
    (16, 1, 64, "bfloat16", "float8_e4m3"),  # fp8 cache: register conversion in the producer
]
NVCC_VARIANT = LOWER_VARIANTS[0]
# tws (opt-in: MLA_BACKEND_SM90_KERNEL=tws): transposed consumers where h x q_len <= 16
TWS_VARIANTS = [
    (16, 1, 64, "bfloat16", "float8_e4m3"),  # the fp8 TP8 decode it is meant for; also nvcc-compiled
    (16, 1, 16, "float16", "float16"),
    (5, 2, 1, "bfloat16", "bfloat16"),  # MTP, 10 of 16 columns (padding), page size 1
]


# A named barrier (bar.sync id, count) in TileLang's CUDA: template arguments up to 0.1.11
# (``tl::__sync_thread_partial<3, 128>()``), function arguments from 0.1.12 (``tl::__sync_thread_partial(3, 128)``).
NAMED_BARRIER = re.compile(r"__sync_thread_partial\s*(?:<\s*(\d+)\s*,\s*(\d+)\s*>\s*\(\s*\)|\(\s*(\d+)\s*,\s*(\d+)\s*\))")


def named_barriers(src: str):
    """``(match, barrier id, thread count)`` of each named barrier in a CUDA source."""
    for m in NAMED_BARRIER.finditer(src):
        yield m, m.group(1) or m.group(3), m.group(2) or m.group(4)


def _vid(v) -> str:
    return "-".join(str(x) for x in v)


# ============================================================================ lowering + nvcc
def _lower(variant, kernel: str = "ws", **overrides):
    """Runs in a worker process: (kernel source, dynamic shared memory bytes); ``overrides``: KernelConfig fields."""
    import dataclasses

    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    from mla_backend.kernels.configs import SM90_KERNELS

    func = ws.build_decode_kernel_ws(*variant, cfg=dataclasses.replace(SM90_KERNELS[kernel], **overrides))
    target = Target(CUDA)
    with tvm.transform.PassContext(config=compat_pass_configs()), target:
        art = tilelang.lower(func, target=target, enable_device_compile=False)
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for _, f in art.device_mod.functions.items()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return art.kernel_source, max(sizes, default=0)


def _lower_apart(variant, kernel: str = "ws", **overrides):
    """``_lower`` in a fresh worker process, for one variant outside the module's fixtures."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_lower, variant, kernel, **overrides).result()


@pytest.fixture(scope="module")
def lowered():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        results = list(pool.map(_lower, LOWER_VARIANTS))
    return dict(zip(LOWER_VARIANTS, results))


@pytest.fixture(scope="module")
def lowered_tws():
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as pool:
        results = list(pool.map(_lower, TWS_VARIANTS, ["tws"] * len(TWS_VARIANTS)))
    return dict(zip(TWS_VARIANTS, results))


def _transposed(variant, kernel: str) -> bool:
    """tws changes the kernel only where it transposes: h x q_len <= 16."""
    return kernel == "tws" and variant[0] * variant[1] <= ws.TWS_COLS


def _budget(variant, kernel: str = "ws") -> dict[str, int]:
    """setmaxnreg of each role of a variant."""
    fp8 = variant[4] != variant[3]
    return dict(zip(("wg0", "wg1", "producer"), ws.register_budget(fp8, transposed=_transposed(variant, kernel))))


def _threads(variant, kernel: str = "ws") -> int:
    return ws.kernel_threads(variant[4] != variant[3], _transposed(variant, kernel))


def _role_marks(variant, kernel: str = "ws") -> dict[str, str]:
    """Each role's setmaxnreg call in the CUDA source of a variant."""
    # setmaxnreg.inc below the launch count is an illegal instruction
    threads = _threads(variant, kernel)
    return {role: f"warpgroup_reg_{'alloc' if ws.grows(regs, threads) else 'dealloc'}<{regs}>"
            for role, regs in _budget(variant, kernel).items()}


def _role_sections(src: str, variant, kernel: str = "ws") -> dict[str, str]:
    """The CUDA source of each warpgroup role (the branches start with their setmaxnreg call)."""
    marks = _role_marks(variant, kernel)
    pos = {name: src.index(m) for name, m in marks.items()}
    order = sorted(pos, key=pos.get)
    bounds = [pos[n] for n in order] + [len(src)]
    return {n: src[bounds[i]:bounds[i + 1]] for i, n in enumerate(order)}


def _thread_dependent_ifs_around(src: str, offset: int) -> list[str]:
    """Headers of the enclosing ``if`` blocks at ``offset`` whose condition reads threadIdx."""
    stack = []
    i = 0
    line_start = 0
    for i, ch in enumerate(src[:offset]):
        if ch == "\n":
            line_start = i + 1
        elif ch == "{":
            stack.append(src[line_start:i].strip())
        elif ch == "}":
            stack.pop()
    return [h for h in stack if h.startswith(("if", "} else if")) and "threadIdx" in h]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("seesaw,transposed", [(False, False), (True, False), (False, True)])
def test_register_budgets_fit_the_launch(fp8, seesaw, transposed):
    """setmaxnreg takes multiples of 8 in 24..256, and the roles share the registers per thread slot the CTA was
    launched with (3 x 168 at 384 threads; tws fp8's 2 producers: 4 x 128), more is an illegal instruction."""
    wg0, wg1, producer = budget = ws.register_budget(fp8, seesaw, transposed)
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in budget), budget
    threads = ws.kernel_threads(fp8, transposed)
    producers = threads // 128 - 2
    assert wg0 + wg1 + producers * producer <= threads // 128 * ws.launch_regs(threads), (budget, threads)
    assert threads == 384 or (fp8 and transposed), "only tws fp8 has more than one producer warpgroup"


@pytest.mark.parametrize("variant", LOWER_VARIANTS, ids=_vid)
def test_ws_kernel_lowers(lowered, variant):
    src, smem = lowered[variant]
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(384, 1\) mla_decode_split_kernel', src)
    assert "tl::wgmma_ss<" in src, "the GEMMs did not lower to Hopper WGMMA"
    wg0, wg1, producer = ws.register_budget(fp8=variant[4] != variant[3])
    assert wg0 + wg1 + producer <= ws.REGS_PER_CTA_SLOT, "setmaxnreg beyond the CTA's launch registers"
    for mark in _role_marks(variant).values():
        assert mark in src

    budget = ws.smem_budget(rs_pv=ws.SM90_WS.rs_pv, merge=ws.SM90_WS.merge_pairs)
    # Exactly the sum of the buffers: TileLang merged no two of them (its liveness analysis is
    # sequential and would not know that the roles run concurrently).
    assert smem == budget["dynamic"], f"dynamic shared memory {smem} B, the budget says {budget}"
    assert smem + budget["static"] <= SM90_SMEM_LIMIT
    # 8 for the pipeline (10 barriers), 1 for the merge tickets (ticket_ready: 2)
    assert len(re.findall(r"\b(uint64_t) \w+_mem\[", src)) == 9, "expected 9 mbarrier arrays (12 barriers)"


def test_seesaw_kernel_lowers():
    """The seesaw schedule (opt-in, MLA_BACKEND_SM90_KERNEL=seesaw): padded MTP row block, fp16."""
    src, smem = _lower_apart((16, 2, 16, "float16", "float16"), "seesaw")
    assert "tl::wgmma_ss<" in src and "tl::wgmma_rs<" in src, "S and the other's P @ V via shared, own P from registers"
    assert src.count(f"warpgroup_reg_alloc<{ws.REGS_SEESAW}>") == 2
    assert f"warpgroup_reg_dealloc<{ws.REGS_SEESAW_PRODUCER}>" in src
    assert 2 * ws.REGS_SEESAW + ws.REGS_SEESAW_PRODUCER <= ws.REGS_PER_CTA_SLOT, "beyond the CTA's launch registers"
    # one more P-sized exchange of row maxima / sums than the plain ws kernel, still under the limit
    assert smem == ws.smem_budget()["dynamic"] + 2 * 64 * 4
    assert smem + 1024 <= SM90_SMEM_LIMIT
    # one k_ready / k_free per tile of each buffer (rope, left, right), and P_b's own barrier
    assert re.search(rf"uint64_t k_ready_mem\[{2 * ws.N_PARTS}\]", src) and re.search(
        rf"uint64_t k_free_mem\[{2 * ws.N_PARTS}\]", src) and "pb_ready" in src
    first_role = src.index(f"warpgroup_reg_alloc<{ws.REGS_SEESAW}>")
    assert "__syncthreads()" not in src[first_role:], "CTA-wide barrier inside a warp role"
    assert {count for _, _, count in named_barriers(src)} == {"128"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("pages_ahead", [True, False])
def test_producer_reads_page_ids_around_the_buffer_wait(monkeypatch, dtype, pages_ahead):
    """pages_ahead (default since session 17): a 16-bit cache's producer reads a block's page ids into its page
    registers before it waits for the block's buffer (k_free), so that the page table's latency overlaps the wait
    instead of delaying the copies; MLA_BACKEND_SM90_PAGES=0 reads them after the wait, as before. Either way the
    registers are read by the copies: TileLang 0.1.11's CUDA codegen crashed on an unused local buffer."""
    from mla_backend.kernels import configs

    if not pages_ahead:
        monkeypatch.setenv(configs.SM90_PAGES_ENV, "0")
    cfg = configs.config_for("sm90")
    assert cfg.pages_ahead is pages_ahead
    for page_size in (64, 16):
        script = ws.build_decode_kernel_ws(16, 1, page_size, dtype, dtype, cfg=cfg).script()
        loop = script[script.index("pages[r] = page_table[") - 400:]
        read, wait = loop.index("pages[r] = page_table["), loop.index("T.mbarrier_wait_parity(k_free")
        assert (read < wait) is pages_ahead, page_size
        assert ("pages[0]" if page_size == 64 else "pages[r]") in loop[wait:], page_size


def check_named_barriers_role_local(src: str, variant, kernel: str = "ws") -> dict[str, str]:
    """A __syncthreads() after the role split, a named barrier shared by two roles, or one inside a
    thread-dependent branch of a role would deadlock or mis-synchronise. Returns the role sections."""
    first_role = min(src.index(m) for m in _role_marks(variant, kernel).values())
    assert "__syncthreads()" not in src[first_role:], "CTA-wide barrier inside a warp role"
    role_conditions = ("((int)threadIdx.x) < 128", "((int)threadIdx.x) < 256")
    ids_by_role = {}
    sections = _role_sections(src, variant, kernel)
    for role, text in sections.items():
        ids = set()
        for m, bar, count in named_barriers(text):
            assert count == "128", f"{role}: named barrier {bar} for {count} threads"
            ids.add(bar)
            offset = src.index(text) + m.start()
            for header in _thread_dependent_ifs_around(src, offset):
                assert any(c in header for c in role_conditions), \
                    f"{role}: named barrier {bar} under a thread-dependent branch: {header}"
        ids_by_role[role] = ids
    # the consumers' cross-warp reductions need some: finding none means the syntax changed, not that all is safe
    assert any(ids_by_role.values()), "no named barrier found in any role (has TileLang's CUDA syntax changed?)"
    roles = list(ids_by_role)
    for i, a in enumerate(roles):
        for b in roles[i + 1:]:
            assert not ids_by_role[a] & ids_by_role[b], f"{a} and {b} share named barrier(s) {ids_by_role[a] & ids_by_role[b]}"
    # TileLang's cross-warp reductions synchronise on named barriers 1 and 2 (bar.sync inside AllReduce)
    assert not {"1", "2"} & set().union(*ids_by_role.values()), "a role's named barrier collides with AllReduce's"
    return sections


@pytest.mark.parametrize("variant", LOWER_VARIANTS, ids=_vid)
def test_ws_kernel_named_barriers_are_role_local(lowered, variant):
    src, _ = lowered[variant]
    sections = check_named_barriers_role_local(src, variant)
    assert not any("tl::AllReduce<" in text and "128, 32" in text for text in sections.values())


def _tile_boxes(producer: str) -> list[int]:
    """The bytes each whole block's tile expects on its k_ready, sorted."""
    return sorted(int(n) for n in re.findall(r"k_ready\[[^\n]*?\]\.expect_transaction\((\d+)\)", producer))


@pytest.mark.parametrize("variant", [LOWER_VARIANTS[0], LOWER_VARIANTS[2], TWS_VARIANTS[0]])
def test_kernels_wait_for_the_previous_kernel_before_any_read(lowered, lowered_tws, variant):
    """TileLang launches every cluster kernel (and every kernel that waits) with programmatic stream serialisation
    allowed: the split kernel may start while the kernel before it runs, if that one triggers early. Its first
    statement after the barrier setup is the wait (griddepcontrol.wait); no read of q, the cache, the metadata or the
    plan comes before it, and it does not trigger its own dependents (slower at b=1). The combines' wait:
    test_lowering.py."""
    body = kernel_body((lowered_tws if variant in TWS_VARIANTS else lowered)[variant][0])
    wait = body.index("cudaGridDependencySynchronize();")
    reads = [m.start() for name in ("blocks_per_part", "cu_blocks", "part_begin_req", "part_end_req", "kv_lens",
                                    "qo_indptr", "page_table", "page_table_start", "k_scale", "sm_scale", "q_nope",
                                    "q_pe", "merge_count") for m in [re.search(rf"\b{name}\[", body)] if m]
    assert reads and wait < min(reads) and "cudaTriggerProgrammaticLaunchCompletion" not in body
    assert "tma_load" not in body[:wait]  # (a descriptor's prefetch may come first: descriptors are parameters)


def test_whole_blocks_arrive_by_tma(lowered):
    """16-bit cache, page size a multiple of 64, an even number of row blocks (cluster_kv, default since session 24):
    the two row-block CTAs of a part are a cluster; of a whole block, rank 0's producer issues the left tile's four
    64 x 64 boxes and rank 1's the right tile's, and rank g % 2 the rope box of block g (cluster_rope, session 25),
    each multicast to both CTAs. The one tma_copy left is never taken (part_hi < part_lo): it makes TileLang pass
    the cache's tensor map, which the multicast issues through. Both CTAs
    expect every tile on its own k_ready (tile_ready: 6 barriers of 128 arrivals). k_free counts its CTA's 256
    consumer threads and one arrival per consumer warp of the other CTA (lane 0, after the warp's GEMMs); the pair
    synchronises after the barriers' initialisation and before exit. Page size 1 and the fp8 cache keep cp.async."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    src, _ = lowered[variant]
    sections = _role_sections(src, variant)
    producer = sections["producer"]
    assert producer.count("tl::tma_load(kv_cache_desc") == 1
    assert re.search(r"if \(part_hi < \(\(\(int\)blockIdx\.x\) \* width\)\) \{\s*if \(tl::tl_shuffle_elect<128>\(\)\) \{\s*"
                     r"k_ready\[0\]\.expect_transaction\(8192\);\s*tl::tma_load\(kv_cache_desc", producer)
    assert producer.count("MLA_TMA_MC(k_ready") == 6  # left / right (four boxes each) and rope tile of each buffer
    assert producer.count("if (tl::block_rank_in_cluster() == 0)") == 2 == producer.count(
        "if (tl::block_rank_in_cluster() == 1)")
    assert len(re.findall(r"if \(tl::block_rank_in_cluster\(\) == \(\(max\(.*\) & 1\)\) \{", producer)) == 2  # rope: g % 2
    assert _tile_boxes(producer) == sorted([64 * 256 * 2] * 4 + [64 * 64 * 2] * 3)  # + the never-taken copy's
    assert [f"k_ready[{i}].init(128);" in src for i in range(7)] == [True] * 6 + [False]
    assert "k_free[0].init(264);" in src and "k_free[1].init(264);" in src
    assert src.count("tl::cluster_sync();") == 2 and src.rstrip().endswith("tl::cluster_sync();\n}")
    for role in ("wg0", "wg1"):
        remote = sections[role].index(".arrive((1 - tl::block_rank_in_cluster()));")
        assert any("% 32) == 0" in h for h in _thread_dependent_ifs_around(src, src.index(sections[role]) + remote))
    assert "tl_shuffle_elect<128>" in producer
    for variant in [(128, 2, 1, "bfloat16", "bfloat16"), (16, 1, 64, "bfloat16", "float8_e4m3")]:
        assert "tma_load(kv_cache_desc" not in lowered[variant][0], variant
        assert "cluster_sync" not in lowered[variant][0], variant


def test_rope_box_per_cta_with_cluster_rope_off():
    """cluster_rope off (MLA_BACKEND_SM90_CLUSTER_ROPE=0, session 24's pairs): the tiles of 256 dims are multicast, and
    each CTA loads its own rope box with tma_copy (one per buffer)."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    src, _ = _lower_apart(variant, "tws", cluster_rope=False)
    producer = _role_sections(src, variant)["producer"]
    assert producer.count("tl::tma_load(kv_cache_desc") == 2 and producer.count("MLA_TMA_MC(k_ready") == 4
    assert "if (part_hi < (((int)blockIdx.x) * width)) {" not in producer  # no never-taken tma_copy needed
    assert _tile_boxes(producer) == sorted([64 * 256 * 2] * 4 + [64 * 64 * 2] * 2)


def test_whole_blocks_per_cta_without_cluster():
    """cluster_kv off (MLA_BACKEND_SM90_CLUSTER=0, the kernel before session 24): each CTA's producer issues all nine
    boxes of a whole block itself, one thread, on the three tiles' k_ready; no cluster barrier or sync."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    src, _ = _lower_apart(variant, "tws", cluster_kv=False)
    producer = _role_sections(src, variant)["producer"]
    assert producer.count("tl::tma_load(kv_cache_desc") == 18 and "MLA_TMA_MC(" not in producer
    assert _tile_boxes(producer) == sorted([64 * 256 * 2] * 4 + [64 * 64 * 2] * 2)
    assert "k_free[0].init(256);" in src and "cluster" not in src.split("extern \"C\" __global__")[-1]


def test_clusters_only_for_an_even_number_of_row_blocks():
    """cluster_kv pairs row blocks 2i and 2i + 1 of a part: the variants with 2 or 4 row blocks and TMA blocks get the
    multicast; one row block (h x q_len <= 64), page sizes below 64 and fp8 caches do not."""
    from mla_backend.kernels import configs

    cfg = configs.SM90_KERNELS[configs.DEFAULT_SM90_KERNEL]
    assert cfg.cluster_kv
    for variant, paired in [((128, 1, 64, "bfloat16", "bfloat16"), True), ((64, 2, 64, "float16", "float16"), True),
                            ((128, 2, 128, "bfloat16", "bfloat16"), True), ((64, 1, 64, "bfloat16", "bfloat16"), False),
                            ((32, 2, 64, "bfloat16", "bfloat16"), False), ((128, 1, 16, "bfloat16", "bfloat16"), False),
                            ((128, 1, 64, "bfloat16", "float8_e4m3"), False)]:
        assert ('"MLA_TMA_MC"' in ws.build_decode_kernel_ws(*variant, cfg=cfg).script()) == paired, variant


def test_one_k_ready_per_buffer_without_tile_ready():
    """tile_ready off (MLA_BACKEND_SM90_TILES=0, the kernel before session 20): each buffer's nine boxes complete on
    that buffer's one k_ready, 73 728 bytes expected on it."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    src, _ = _lower_apart(variant, "tws", tile_ready=False)
    producer = _role_sections(src, variant)["producer"]
    for buf in (0, 1):
        loads = re.findall(rf"tl::tma_load\(kv_cache_desc, k_ready\[{buf}\]", producer)
        expected = [int(n) for n in re.findall(rf"k_ready\[{buf}\]\.expect_transaction\((\d+)\)", producer)]
        assert len(loads) == 9 and sum(expected) == 64 * 576 * 2, (len(loads), expected)
    assert "k_ready[2].init" not in src


def test_wg0_multiplies_p_from_registers(lowered):
    """rs_pv (default): WG0's P V is an RS WGMMA; P goes to shared memory by mla_store_p64, which writes the
    128-byte-swizzled K-major tile that WG1's descriptor for that address names (layout type 1), and WG0's block
    loop has no named barrier (only the segment's start and epilogue do)."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    sections = _role_sections(lowered[variant][0], variant)
    wg0, wg1 = sections["wg0"], sections["wg1"]
    assert "tl::wgmma_rs<" in wg0 and "tl::wgmma_rs<" not in wg1
    stores = set(re.findall(r"mla_store_p64\(\(&\(\(\(\w+\*\)buf_dyn_shmem\)\[(\d+)\]\)\), p_frag\)", wg0))
    assert len(stores) == 1, stores
    assert re.search(rf"initialize_wgmma_descriptor<1, 1, 64>\(desc_\w+, \(&\(\(\(\w+\*\)buf_dyn_shmem\)"
                     rf"\[{stores.pop()}\]\)\)\)", wg1), "WG1 does not read P as the 128-byte-swizzled tile"
    assert "mla_store_rows64(" in wg0
    # none in the block loop: the segment's start, the l hand-off and the merge ticket (merge_pairs) have one each
    assert len(list(named_barriers(wg0))) == 3


def test_seesaw_tiles_arrive_by_tma():
    """seesaw, page 64: each tile (rope, left, right) of a whole block is its own TMA copy on its own k_ready."""
    src, _ = _lower_apart((32, 2, 64, "bfloat16", "bfloat16"), "seesaw")
    assert src.count("tl::tma_load(kv_cache_desc") == 18
    assert _tile_boxes(src) == sorted([64 * 64 * 2] * 2 + [64 * 256 * 2] * 4)


@pytest.mark.parametrize("env", ["", "MLA_BACKEND_SM90_PVEARLY", "MLA_BACKEND_SM90_RESCALE", "MLA_BACKEND_SM90_PFREE"])
def test_wg0_follows_fa3_order(monkeypatch, env):
    """Session 23, ws WG0 per block (each step has its env switch back): the wait for WG1's release of P right after S
    (pfree_early), O's rescale before P's exp2s (rescale_early), and its own P V issued before the fence and p_ready
    that hand P to WG1 (pv_early). With a switch at 0 that step is back where it was."""
    from mla_backend.kernels import configs

    if env:
        monkeypatch.setenv(env, "0")
    src = ws.build_decode_kernel_ws(128, 2, 64, "bfloat16", "bfloat16", cfg=configs.config_for("sm90")).script()

    def at(pattern):
        found = re.search(pattern, src)
        assert found, pattern
        return found.start()

    row_max, exp = at(r"mla_row_max2"), at(r"T\.exp2\(acc_s\[i, j\]")
    pfree_wait = at(r"mbarrier_wait_parity\(p_free\w*\[0\]")
    rescale = at(r"acc_o_l\[i, d\] = acc_o_l\[i, d\] \* alpha\[i\]")
    wg0_pv, p_ready = at(r"wgmma_gemm\(T\.region\(p_frag"), at(r"ptx_arrive_barrier\(p_ready\w*\[0\]\)")
    assert (pfree_wait < row_max) == (env != "MLA_BACKEND_SM90_PFREE")
    assert (rescale < exp) == (env != "MLA_BACKEND_SM90_RESCALE")
    assert (wg0_pv < p_ready) == (env != "MLA_BACKEND_SM90_PVEARLY")


@pytest.mark.parametrize("env,field,marker", [("MLA_BACKEND_SM90_TMA", "tma_kv", "tma_copy"),
                                              ("MLA_BACKEND_SM90_RSPV", "rs_pv", "mla_store_p64"),
                                              ("MLA_BACKEND_SM90_MERGE", "merge_pairs", "mla_merge_ticket"),
                                              ("MLA_BACKEND_SM90_PVFIRST", "pv_first", "mla_row_sum_part"),
                                              ("MLA_BACKEND_SM90_TREEMAX", "tree_max", "mla_row_max2"),
                                              ("MLA_BACKEND_SM90_FFMA", "scale_in_exp", "m_cur.data, scale_log2)"),
                                              # pv_early: P's stores through a read-only pointer (no fence of TileLang's)
                                              ("MLA_BACKEND_SM90_PVEARLY", "pv_early", "p_shared.data, 0, 4096, 1"),
                                              ("MLA_BACKEND_SM90_CLUSTER", "cluster_kv", '"MLA_TMA_MC"'),
                                              # cluster_rope: the rope box multicast by rank g % 2
                                              ("MLA_BACKEND_SM90_CLUSTER_ROPE", "cluster_rope",
                                               "T.block_rank_in_cluster() == g % 2"),
                                              # pdl: the wait for the stream's previous kernel
                                              ("MLA_BACKEND_SM90_PDL", "pdl", "T.pdl_sync()")])
def test_setting_off_gives_the_earlier_kernel(monkeypatch, env, field, marker):
    """Each later change to the default kernel has an env switch back (0): KV blocks by TMA (session 14), WG0's P V
    from registers (15), two-part requests merged in the split kernel (16), WG0's row sums behind its P V (17; the
    page ids read ahead, also 17, in test_producer_reads_page_ids_around_the_buffer_wait), S's row max by a tree
    (22), the softmax scale inside P's exp2 and WG0's P V before P's fence (23; the rest of 23 in
    test_wg0_follows_fa3_order), the row-block CTA pairs sharing each block by TMA multicast (24), the rope box
    multicast too (25), the wait for the stream's previous kernel (28). Other values are refused."""
    from mla_backend.kernels import configs

    monkeypatch.setenv(env, "0")
    cfg = configs.config_for("sm90")
    default = configs.SM90_KERNELS[configs.DEFAULT_SM90_KERNEL]
    assert cfg == dataclasses.replace(default, **{field: False}) and getattr(default, field)
    assert marker not in ws.build_decode_kernel_ws(128, 1, 64, "bfloat16", "bfloat16", cfg=cfg).script()
    assert marker in ws.build_decode_kernel_ws(128, 1, 64, "bfloat16", "bfloat16", cfg=default).script()
    monkeypatch.setenv(env, "2")
    with pytest.raises(ValueError, match=env):
        configs.config_for("sm90")


def test_two_part_requests_are_merged_by_both_consumers(lowered):
    """merge_pairs (default): both consumer warpgroups take the program's ticket (thread 0's, published by a
    one-arrival mbarrier per ticket slot), merge their half of O from the other part's partial, and count a stored
    partial (named barrier 13 over their 256 threads); the producer does none of it. The combine then skips two-part
    requests (``merged=2``), and the seesaw kernel merges nothing."""
    from mla_backend.kernels import configs
    from mla_backend.kernels.mla_decode import build_combine_kernel

    variant = (128, 1, 64, "bfloat16", "bfloat16")
    sections = _role_sections(lowered[variant][0], variant)
    for role, add in (("wg0", "mla_merge2_add_rows("), ("wg1", "mla_merge2_add_rows(")):
        for call in ("mla_merge_ticket(", "mla_merge_wait(", "mla_merge_done(", "mla_merge2_weights<false>(", add):
            assert call in sections[role], (role, call)
    assert "mla_merge" not in sections["producer"]
    assert f"barrier.sync {ws.MERGE_NAMED_BARRIER}, 256" in lowered[variant][0]
    assert "ticket_ready[0].init(1);" in lowered[variant][0] and "ticket_ready[1].init(1);" in lowered[variant][0]
    assert "mbarrier.arrive.release.cta" in lowered[variant][0]
    assert configs.merged_parts(configs.SM90_SEESAW) == 0 == configs.merged_parts(configs.SM90)
    assert "mla_merge" not in ws.build_decode_kernel_ws(128, 1, 64, "bfloat16", "bfloat16",
                                                       cfg=configs.SM90_SEESAW).script()
    assert "if n_read[0] > 2:" in build_combine_kernel(16, 1, "bfloat16", merged=2).script()


def test_block_trace_is_off_by_default_and_calls_nothing():
    """KernelConfig.trace_part (scripts/trace_blocks.py): off in every shipped config, no trace code then; on, each
    role records its steps inline (no function call: ptxas would serialise the WGMMAs) into the unused last slot."""
    from mla_backend.kernels import configs

    assert all(cfg.trace_part < 0 for cfg in configs.SM90_KERNELS.values())
    variant = (128, 2, 64, "bfloat16", "bfloat16")
    plain = ws.build_decode_kernel_ws(*variant, cfg=configs.SM90_TWS).script()
    traced = ws.build_decode_kernel_ws(*variant, cfg=dataclasses.replace(configs.SM90_TWS, trace_part=3)).script()
    assert "mla_trace" not in plain
    for call in ("mla_trace_begin", "mla_trace_end", "mla_trace"):
        assert f'"{call}"' in traced, call
    assert "printf" not in ws.TRACE_PRELUDE and "noinline" not in ws.TRACE_PRELUDE
    assert "blockIdx.x == 3" in ws.trace_prelude(3) and "MLA_TRACE_" not in ws.trace_prelude(3)


@pytest.mark.parametrize("variant", TWS_VARIANTS, ids=_vid)
def test_tws_kernel_lowers(lowered_tws, variant):
    """tws: S^T = K Q^T and O^T = V^T P^T as m64n16 WGMMAs (V read MN-major), column max reduced across WG0's
    warps in one exchange (mla_colmax4, named barrier 1), column sums by TileLang's AllReduce once per segment (
    barriers 1 and 2, WG0 only), a quarter of the ws kernel's Q and P."""
    src, smem = lowered_tws[variant]
    threads = _threads(variant, "tws")
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\({threads}, 1\) mla_decode_split_kernel', src)
    shapes = set(re.findall(r"tl::wgmma_ss<[^>]*?kFloat32, (\d+), (\d+), (\d+), (true|false), (true|false)", src))
    assert shapes == {("64", "16", "16", "false", "false"), ("64", "16", "16", "true", "false")}, shapes
    for mark in _role_marks(variant, "tws").values():
        assert mark in src
    sections = check_named_barriers_role_local(src, variant, "tws")
    # the column max: one exchange per block (mla_colmax4: shuffles, one named barrier 1), WG0 only
    reducing = [role for role, text in sections.items() if "mla_colmax4(acc_s" in text]
    assert reducing == ["wg0"], f"cross-warp column max in {reducing}"
    assert "tl::AllReduce<tl::MaxOp" not in src
    assert "tl::AllReduce<tl::SumOp, 128, 32" in sections["wg0"], "column sums of P, once per segment"
    if variant[4] != variant[3]:
        # fp8: the producer's threads run independently (TileLang 0.1.9 put a varying number of named barriers
        # among them when it could see the converted stores), loading the next block while converting this one
        assert not list(named_barriers(sections["producer"])), "named barrier among the fp8 producer's warps"
        producer = sections["producer"]
        after_free = producer[producer.index("k_free["):]
        first_load = after_free.index("mla_ldg16(")
        # every load counts on one scoreboard, so a conversion waits for all of the thread's loads in flight
        if ws.TWS_FP8_PRODUCERS > 1:
            # blocks taken in turn: a segment's first block of this producer (a loop over its 2 rows), then after
            # converting a whole block the loads of its next one into the same registers
            assert producer.count("mla_ldg16(") == 2
            assert "k_ready" in after_free[after_free.rindex("mla_e4m3x16_store"):first_load], \
                "a block's loads issued before the previous block of this producer is converted and handed over"
        else:
            # loads into each of the two row sets at a segment's start (a loop over 2 rows: 2 call sites), and
            # per block the next block's 2 rows into the other set (4); after the buffer is free (k_free), one
            # conversion (it waits for this block's loads) comes before the next block's loads
            assert producer.count("mla_ldg16(") == 6
            assert after_free[:first_load].count("mla_e4m3x16_store") == 1, "next block's loads before the drain"
    assert smem == ws.smem_budget(transposed=True, merge=True)["dynamic"], f"dynamic shared memory {smem} B"
    # 8 for the pipeline (10 barriers), 1 for the merge tickets (ticket_ready: 2)
    assert len(re.findall(r"\b(uint64_t) \w+_mem\[", src)) == 9, "expected 9 mbarrier arrays (12 barriers)"


def test_tws_is_the_ws_kernel_beyond_16_rows():
    """tws only changes the kernel where h x q_len fits one m64n16 tile; other shapes get the ws kernel."""
    from mla_backend.kernels.configs import SM90_TWS, SM90_WS

    for variant in [(32, 1, 64, "bfloat16", "bfloat16"), (16, 2, 16, "float16", "float8_e4m3fn")]:
        assert ws.build_decode_kernel_ws(*variant, cfg=SM90_TWS).script() == \
            ws.build_decode_kernel_ws(*variant, cfg=SM90_WS).script()
    assert ws.build_decode_kernel_ws(16, 1, 64, "bfloat16", "bfloat16", cfg=SM90_TWS).script() != \
        ws.build_decode_kernel_ws(16, 1, 64, "bfloat16", "bfloat16", cfg=SM90_WS).script()


def _cuobjdump() -> str | None:
    """cuobjdump from PATH, CUDA_HOME, $CUOBJDUMP, or the nvidia-cuda-cuobjdump wheel."""
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "cuobjdump")):
            return os.path.join(home, "bin", "cuobjdump")
    try:
        import nvidia  # the wheel nvidia-cuda-cuobjdump installs nvidia/cu13/bin/cuobjdump

        for base in nvidia.__path__:
            for sub in ("cu13", "cuda_cuobjdump"):
                path = os.path.join(base, sub, "bin", "cuobjdump")
                if os.path.exists(path):
                    return path
    except ImportError:
        pass
    return None


def role_registers(sass: str, budget: dict[str, int]) -> dict[str, dict]:
    """Per warpgroup role: highest register index used, local-memory instructions, HGMMA count.

    The SASS is cut at each ``USETMAXREG`` (the role's setmaxnreg); ptxas lays the roles out one after
    another. After the last ``EXIT`` come the out-of-line mbarrier wait loops: each belongs to the role whose
    branch jumps to it (a loop holds the registers of that role's wait).
    """
    names = {regs: role for role, regs in budget.items()}
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    last_exit = max(i for i, (_, ins) in enumerate(code) if re.fullmatch(r"EXIT", ins.strip()))
    role_at, name = [], "prologue"
    for _, ins in code[:last_exit + 1]:
        if "USETMAXREG" in ins:
            name = names[int(ins.split()[-1], 16)]
        role_at.append(name)
    tail_owner = {}  # out-of-line loop start -> the role that branches there
    for (_, ins), role in zip(code, role_at):
        target = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        if target and int(target.group(1), 16) > code[last_exit][0]:
            tail_owner[int(target.group(1), 16)] = role
    for addr, _ in code[last_exit + 1:]:
        name = tail_owner.get(addr, name)
        role_at.append(name)
    out = {}
    for role in dict.fromkeys(role_at):
        body = [ins for (_, ins), r in zip(code, role_at) if r == role]
        regs = [int(r) for ins in body for r in re.findall(r"\bR(\d+)\b", ins)]
        out[role] = {"max_reg": max(regs, default=-1), "local_mem": sum(bool(re.search(r"\b(LDL|STL)\b", i)) for i in body),
                     "hgmma": sum("HGMMA" in i for i in body)}
    return out


@pytest.mark.parametrize("kernel", ["ws", "tws"])
def test_nvcc_compiles_ws_for_sm90a(request, kernel, tmp_path):
    """TileLang's nvcc flags, with -c so ptxas runs: register limits, spills and WGMMA show here."""
    nvcc = find_nvcc()
    import tilelang

    variant = NVCC_VARIANT if kernel == "ws" else TWS_VARIANTS[0]
    tl_dir = os.path.dirname(tilelang.__file__)
    src, _ = request.getfixturevalue("lowered" if kernel == "ws" else "lowered_tws")[variant]
    cu = tmp_path / "ws.cu"
    cu.write_text(src)
    keep = tmp_path / "keep"
    keep.mkdir()
    cmd = [nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--use_fast_math", "-w",
           "-Xptxas", "-v", "-keep", f"-keep-dir={keep}", f"-I{tl_dir}/src", f"-I{tl_dir}/3rdparty/cutlass/include",
           f"-I{tl_dir}/3rdparty/cutlass/tools/util/include", "-c", str(cu), "-o", str(tmp_path / "ws.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    report = proc.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert regs and spills, report
    # 384 threads x 168 registers = 64512 <= 65536: the launch bound caps the kernel at 168 (tws fp8, 512: 128)
    threads = _threads(variant, kernel)
    assert int(regs.group(1)) <= ws.launch_regs(threads), report
    # no spills, and no stack (a register array with a thread-dependent index lands in local memory)
    assert spills.groups() == ("0", "0", "0"), f"local memory: {spills.group(0)}"
    ptx = "".join(p.read_text() for p in keep.glob("*.ptx"))
    assert "wgmma.mma_async" in ptx, "no WGMMA in the PTX"
    budget = _budget(variant, kernel)
    for role in ("wg0", "wg1", "producer"):
        direction = "inc" if ws.grows(budget[role], threads) else "dec"
        assert f"setmaxnreg.{direction}.sync.aligned.u32 {budget[role]}" in ptx

    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        return  # per-role registers need cuobjdump (pip install nvidia-cuda-cuobjdump)
    dump = subprocess.run([cuobjdump, "-sass", str(tmp_path / "ws.o")], capture_output=True, text=True)
    if dump.returncode != 0 or "USETMAXREG" not in dump.stdout:
        return  # e.g. cuobjdump without its nvdisasm: nothing to read the roles from
    per_role = role_registers(dump.stdout, budget)
    for role, cap in budget.items():
        assert per_role[role]["max_reg"] < cap, f"{role} uses R{per_role[role]['max_reg']} with setmaxnreg {cap}"
        assert per_role[role]["local_mem"] == 0, f"{role} touches local memory"
    assert per_role["wg0"]["hgmma"] > 0 and per_role["wg1"]["hgmma"] > 0


# ============================================================================ protocol simulation
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


def plan_parts(kv_lens, width, num_parts, block_n=64):
    """The planner's split (mla_backend.planner.SplitPlanner.plan) for an arbitrary width."""
    import bisect

    cu = [0]
    for n in kv_lens:
        cu.append(cu[-1] + -(-n // block_n))
    total = cu[-1]
    begin, end = [], []
    for p in range(num_parts):
        lo, hi = p * width, min((p + 1) * width, total)
        b = bisect.bisect_right(cu[1:], lo)
        e = bisect.bisect_right(cu[1:], hi - 1)
        begin.append(b)
        end.append(e if hi > lo else b - 1)
    return cu, begin, end


def part_segments(cu, width, part, begin, end):
    """The kernel's request loop for one part: (req, blk_lo, blk_hi, g0) of each non-empty segment."""
    part_lo = part * width
    part_hi = min(part_lo + width, cu[-1])
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


def simulate_seesaw_part(segs, *, seed=0, mutation=None, max_steps=5_000_000):
    """The seesaw schedule (MLA_BACKEND_SM90_KERNEL=seesaw) of one program, as simulate_part does for ws.

    Each KV buffer is three tiles (rope ``t``, left ``l``, right ``r``) with their own k_ready / k_free; a
    segment's blocks go in pairs (a, b): WG0 computes S_a, writes P_a and m0 to ``p``, WG1 computes S_b, writes
    P_b into b's rope tile and M to ``mb``; WG0 multiplies V_a and V_b's left halves, WG1 the right halves.
    Returns the number of pairs.
    """
    rng = random.Random(seed)
    tiles = [f"kv{b}{x}" for b in (0, 1) for x in "tlr"]
    bars = {f"k_ready_{t}": MBarrier(f"k_ready[{t}]", 128) for t in tiles}
    bars.update({f"k_free_{t}": MBarrier(f"k_free[{t}]", 128) for t in tiles})
    bars.update({"q_ready": MBarrier("q_ready", 128), "q_free": MBarrier("q_free", 256),
                 "p_ready": MBarrier("p_ready", 128), "p_free": MBarrier("p_free", 128),
                 "pb_ready": MBarrier("pb_ready", 128), "l_ready": MBarrier("l_ready", 256),
                 "l_free": MBarrier("l_free", 256)})
    bufs = {n: Buffer(n) for n in tiles + ["q", "p", "mb", "l0", "l1"]}

    per_segment, fills, run, pc = [], [0, 0], 0, 0
    for s, (_, blk_lo, blk_hi, g0) in enumerate(segs):
        blks = []
        for blk in range(blk_hi - blk_lo):
            g = g0 + blk
            b = ws.kv_buffer(g)
            blks.append((g, b, fills[b], run))
            fills[b] += 1
            run += 1
        pairs = []
        for k in range(0, len(blks), 2):
            pairs.append((pc, blks[k], blks[k + 1] if k + 1 < len(blks) else None))
            pc += 1
        per_segment.append((s, blks, pairs))
    n_blocks, n_pairs = run, pc

    def score(group, tick, blk, s):
        """S over a block's three tiles, each waited for and issued in turn, then wait_wgmma."""
        g, b, fill, r = blk
        for x in "tlr":
            yield ("wait", f"k_ready_kv{b}{x}", ws.kv_ready_parity(g), fill)
            yield ("rbegin", f"kv{b}{x}", r)
        yield ("rbegin", "q", s)
        yield ("sync", group, next(tick))
        for x in "tlr":
            yield ("rend", f"kv{b}{x}", r)
        yield ("rend", "q", s)

    def gemm(group, tick, *reads):
        """A warpgroup-collective WGMMA reading ``(buffer, tag)`` pairs from shared memory, then its wait."""
        yield ("sync", group, next(tick))
        for buf, tag in reads:
            yield ("rbegin", buf, tag)
        for buf, tag in reads:
            yield ("rend", buf, tag)

    def consumer(group, w, mine, other, pair_ops):
        """A consumer warp: per segment, Q, ``pair_ops`` for each pair, then the row-sum exchange (both consumers
        write their own l, wait for the other's). ``tick`` numbers the warpgroup's collective syncs."""
        tick = itertools.count(1)
        for seg, (s, _, pairs) in enumerate(per_segment):
            yield ("wait", "q_ready", ws.seg_ready_parity(seg), s)
            for k, (pc, a, b) in enumerate(pairs):
                yield from pair_ops(group, tick, w, s, k == len(pairs) - 1, pc, a, b)
            yield ("wait", "l_free", ws.seg_free_parity(seg), s - 1)
            yield ("sync", group, next(tick))
            yield ("wbegin", mine, w)
            yield ("wend", mine, w, s)
            yield ("arrive", "l_ready", s)
            yield ("wait", "l_ready", ws.seg_ready_parity(seg), s)
            yield ("rbegin", other, s)
            yield ("rend", other, s)
            yield ("arrive", "l_free", s)

    def wg0_pair(group, tick, w, s, last, pc, a, b):
        ga, ba, fa, ra = a
        yield from score(group, tick, a, s)
        yield ("arrive", f"k_free_kv{ba}t", fa)  # only S_a reads a's rope tile
        if last:
            yield ("arrive", "q_free", s)
        yield ("wait", "p_free", ws.pair_free_parity(pc), pc - 1)
        yield ("sync", group, next(tick))  # TileLang's barrier before the P_a / m0 stores
        yield ("wbegin", "p", w)
        yield ("wend", "p", w, ("P", pc))
        yield ("arrive", "p_ready", pc)  # after fence.proxy.async
        yield from gemm(group, tick, (f"kv{ba}l", ra))  # P_a (registers) @ V_a[:, :256]
        yield ("arrive", f"k_free_kv{ba}l", fa)
        if mutation != "wg0_skips_pb_wait":
            yield ("wait", "pb_ready", ws.pair_ready_parity(pc), pc)
        yield ("rbegin", "mb", pc)  # M
        yield ("rend", "mb", pc)
        if b is not None:
            gb, bb, fb, rb = b
            yield ("wait", f"k_ready_kv{bb}l", ws.kv_ready_parity(gb), fb)
            # P_b (in b's rope tile) @ V_b[:, :256]
            yield from gemm(group, tick, (f"kv{bb}t", ("P", rb)), (f"kv{bb}l", rb))
            if mutation != "wg1_releases_p_b":
                yield ("arrive", f"k_free_kv{bb}t", fb)
            yield ("arrive", f"k_free_kv{bb}l", fb)

    def wg1_pair(group, tick, w, s, last, pc, a, b):
        ga, ba, fa, ra = a
        if b is not None:
            gb, bb, fb, rb = b
            yield from score(group, tick, b, s)
        if last:
            yield ("arrive", "q_free", s)
        yield ("wait", "p_ready", ws.pair_ready_parity(pc), pc)
        yield ("rbegin", "p", ("P", pc))  # m0
        yield ("rend", "p", ("P", pc))
        if b is not None:  # P_b into b's rope tile (TileLang's barrier before the stores)
            yield ("sync", group, next(tick))
            yield ("wbegin", f"kv{bb}t", w)
            yield ("wend", f"kv{bb}t", w, ("P", rb))
            if mutation == "wg1_releases_p_b":
                yield ("arrive", f"k_free_kv{bb}t", fb)
        yield ("sync", group, next(tick))  # before the M stores
        yield ("wbegin", "mb", w)
        yield ("wend", "mb", w, pc)
        yield ("arrive", "pb_ready", pc)  # after fence.proxy.async
        yield ("wait", f"k_ready_kv{ba}r", ws.kv_ready_parity(ga), fa)
        yield from gemm(group, tick, ("p", ("P", pc)), (f"kv{ba}r", ra))  # P_a (shared) @ V_a[:, 256:]
        yield ("arrive", "p_free", pc)
        yield ("arrive", f"k_free_kv{ba}r", fa)
        if b is not None:
            yield from gemm(group, tick, (f"kv{bb}r", rb))  # P_b (registers) @ V_b[:, 256:]
            yield ("arrive", f"k_free_kv{bb}r", fb)

    def producer(w):
        seg = 0
        for s, blks, _ in per_segment:
            yield ("wait", "q_free", ws.seg_free_parity(seg), s - 1)
            yield ("copy", "q", w, s)
            yield ("noinc", "q_ready", s)
            for g, b, fill, r in blks:
                for x in "tlr":
                    yield ("wait", f"k_free_kv{b}{x}", ws.kv_free_parity(g), fill - 1)
                    yield ("copy", f"kv{b}{x}", w, r)
                    yield ("noinc", f"k_ready_kv{b}{x}", fill)
            seg += 1
        if n_blocks:  # the tail: the part's last right tile
            g_last = n_blocks - 1
            b = ws.kv_buffer(g_last)
            assert ws.part_barrier(g_last, ws.PART_R) == 3 * b + 2
            yield ("wait", f"k_ready_kv{b}r", ws.kv_ready_parity(g_last), fills[b] - 1)

    warps = [("wg0", w, consumer("wg0", w, "l0", "l1", wg0_pair)) for w in range(4)] + \
            [("wg1", w, consumer("wg1", w, "l1", "l0", wg1_pair)) for w in range(4)] + \
            [("producer", w, producer(w)) for w in range(4)]
    run_warps(warps, bars, bufs, rng, max_steps)
    for name in ("p_ready", "p_free", "pb_ready"):
        assert bars[name].completions == n_pairs, name
    for x in "tlr":
        assert sum(bars[f"k_free_kv{b}{x}"].completions for b in (0, 1)) == n_blocks
    assert bars["q_ready"].completions == len(segs) == bars["l_ready"].completions
    return n_pairs


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


def test_protocol_random_plans():
    rng = random.Random(2024)
    runs = 0
    for trial in range(150):
        lens = [rng.choice((0, 1, 64, 65, 127, 128, 129, rng.randrange(1, 1500))) for _ in range(rng.randrange(1, 10))]
        total = sum(-(-n // 64) for n in lens)
        num_parts = rng.randrange(1, 6)
        width = max(rng.choice((1, 2, 3, 4)), -(-total // num_parts))
        cu, begin, end = plan_parts(lens, width, num_parts)
        for part in range(num_parts):
            segs = part_segments(cu, width, part, begin, end)
            simulate_part(segs, fp8=trial % 3 != 1, producers=1 + (trial % 3 == 2), seed=trial * 31 + part,
                          rs_pv=trial % 3 != 2 and trial % 2 == 0)
            if trial % 3 == 1:  # the 16-bit cache's kernel, also with TMA blocks, per-tile k_ready or not
                simulate_part(segs, seed=trial * 31 + part, kv_lens=lens, rs_pv=trial % 2 == 1,
                              tile_ready=trial % 4 != 1)
                simulate_part(segs, seed=trial * 37 + part, tile_ready=True)  # gathers only
            runs += 1
    assert runs > 150


def test_protocol_with_the_real_planner():
    """Plans made by mla_backend.planner.SplitPlanner with 64-token blocks (the kernel's block size)."""
    torch = pytest.importorskip("torch")
    from mla_backend.planner import SplitPlanner

    rng = random.Random(7)
    for trial in range(20):
        batch = rng.randrange(1, 9)
        lens = [rng.choice((0, 1, 64, 100, rng.randrange(1, 4000))) for _ in range(batch)]
        planner = SplitPlanner(batch, 16, 1, "cpu", num_sms=rng.choice((4, 8, 16)), block_n=ws.SM90_WS.block_n)
        plan = planner.plan(torch.tensor(lens, dtype=torch.int32))
        cu = plan.cu_blocks[: batch + 1].tolist()
        width = int(plan.blocks_per_part.item())
        begin, end = plan.part_begin_req.tolist(), plan.part_end_req.tolist()
        assert (cu, begin, end) == plan_parts(lens, width, plan.num_parts)
        for part in range(plan.num_parts):
            producers = ws.TWS_FP8_PRODUCERS if trial % 4 == 1 else 1
            simulate_part(part_segments(cu, width, part, begin, end), seed=trial, fp8=trial % 2 == 1,
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


def test_seesaw_tile_barriers_are_the_kernel_indices():
    """part_barrier: buffer-major, three tiles each, in the order the producer refills them."""
    assert (ws.PART_T, ws.PART_L, ws.PART_R) == (0, 1, 2) and ws.N_PARTS == 3
    assert [ws.part_barrier(g, p) for g in (4, 7) for p in range(3)] == [0, 1, 2, 3, 4, 5]
    for pc in range(8):
        assert ws.pair_ready_parity(pc) == pc & 1 and ws.pair_free_parity(pc) == (pc & 1) ^ 1


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_seesaw_protocol_edge_cases(case):
    """Odd block counts (a pair without b), empty requests, parts spanning requests: no aliasing, no deadlock,
    no tile read while refilled (P_b lives in b's rope tile until WG0's P_b V_b)."""
    kv_lens, width, num_parts = EDGE_CASES[case]
    cu, begin, end = plan_parts(kv_lens, width, num_parts)
    for part in range(num_parts):
        for seed in range(3):
            simulate_seesaw_part(part_segments(cu, width, part, begin, end), seed=seed)


def test_seesaw_protocol_random_plans():
    rng = random.Random(7)
    for trial in range(60):
        kv_lens = [rng.choice((0, 1, 63, 64, 65, 200, 640, 2000)) for _ in range(rng.randint(1, 6))]
        total = sum(-(-n // 64) for n in kv_lens)
        width = rng.randint(1, max(1, total))
        num_parts = -(-total // width) if total else 1
        cu, begin, end = plan_parts(kv_lens, width, num_parts)
        for part in range(num_parts):
            simulate_seesaw_part(part_segments(cu, width, part, begin, end), seed=trial)


@pytest.mark.parametrize("mutation,error", [("wg1_releases_p_b", ProtocolError),
                                            ("wg0_skips_pb_wait", ProtocolError)])
def test_seesaw_simulation_catches_broken_protocols(mutation, error):
    """Releasing b's rope tile when P_b is written (before WG0 has read it), or reading M without waiting
    for pb_ready, must fail for some plan and schedule."""
    cu, begin, end = plan_parts([1000, 300, 65], 8, 4)
    with pytest.raises(error):
        for part in range(4):
            for seed in range(40):
                simulate_seesaw_part(part_segments(cu, 8, part, begin, end), seed=seed, mutation=mutation)
