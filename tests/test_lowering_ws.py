"""The Hopper kernel (``kernels/sm90/``): lowering and nvcc. Its barrier protocol: tests/test_lowering_ws_protocol.py.

Two kinds of checks, all on a machine without a GPU:

* TileLang lowers the kernel for ``sm_90a`` (a few variants: 16 / 128 heads, q_len 1 / 2, page sizes
  1 / 16 / 64, bf16 / fp16, fp8 cache); the generated CUDA has WGMMA, ``setmaxnreg``, exactly the
  shared memory of the budget (so TileLang aliased no buffer between roles), and no CTA-wide or
  role-divergent named barrier after the warp-role split (either would hang).
* nvcc + ptxas compile one variant for sm_90a: no spills; the PTX has ``wgmma.mma_async``; with a
  ``cuobjdump`` at hand, each warpgroup role's SASS stays under its ``setmaxnreg`` budget.
Each lowering takes ~20-35 s on 2 cores; the variants are lowered in 2 processes once per test session.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import re
import shutil
import subprocess

import pytest
from toolchain import find_nvcc, kernel_body

if os.environ.get("CI"):
    import tilelang  # noqa: F401  (in CI a broken TileLang install must fail, not skip)
else:
    pytest.importorskip("tilelang")

from mla_backend.kernels import configs, sm90  # noqa: E402  (imports tilelang.language)
from mla_backend.kernels.configs import compat_pass_configs  # noqa: E402
from mla_backend.kernels.sm90 import protocol as ws  # noqa: E402

SM90_SMEM_LIMIT = 232448  # 227 KiB: static + dynamic shared memory one block may use on H100 / H200
# dict form: TileLang >= 0.1.11 rejects the "cuda -arch=sm_90a" string; 0.1.9 takes both
CUDA = {"kind": "cuda", "arch": "sm_90a"}

# (num_heads, q_len, page_size, dtype, kv_dtype)
LOWER_VARIANTS = [
    (128, 1, 64, "bfloat16", "bfloat16"),  # TP1, compute-bound; also nvcc-compiled
    (16, 2, 16, "float16", "float16"),  # TP8, MTP, padded row block (32 of 64 rows)
    (128, 2, 1, "bfloat16", "bfloat16"),  # SGLang page size 1, 4 row blocks
    (32, 1, 64, "bfloat16", "float8_e4m3"),  # fp8 cache: register conversion in the producer
]
NVCC_VARIANT = LOWER_VARIANTS[0]
# tws: transposed consumers where h x q_len <= 16
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
def _lower(variant, **overrides):
    """Runs in a worker process: (kernel source, dynamic shared memory bytes); ``overrides``: KernelConfig fields."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    func = sm90.build_decode_kernel(*variant, cfg=dataclasses.replace(configs.SM90, **overrides))
    target = Target(CUDA)
    with tvm.transform.PassContext(config=compat_pass_configs()), target:
        art = tilelang.lower(func, target=target, enable_device_compile=False)
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for _, f in art.device_mod.functions.items()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return art.kernel_source, max(sizes, default=0)


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
        results = list(pool.map(_lower, TWS_VARIANTS))
    return dict(zip(TWS_VARIANTS, results))


def _transposed(variant) -> bool:
    """The consumers transpose where h x q_len <= 16."""
    return variant[0] * variant[1] <= ws.TWS_COLS


def _budget(variant) -> dict[str, int]:
    """setmaxnreg of each role of a variant."""
    fp8 = variant[4] != variant[3]
    return dict(zip(("wg0", "wg1", "producer"), ws.register_budget(fp8, transposed=_transposed(variant))))


def _threads(variant) -> int:
    return ws.kernel_threads(variant[4] != variant[3], _transposed(variant))


def _role_marks(variant) -> dict[str, str]:
    """Each role's setmaxnreg call in the CUDA source of a variant."""
    # setmaxnreg.inc below the launch count is an illegal instruction
    threads = _threads(variant)
    return {role: f"warpgroup_reg_{'alloc' if ws.grows(regs, threads) else 'dealloc'}<{regs}>"
            for role, regs in _budget(variant).items()}


def _role_sections(src: str, variant, marks: dict[str, str] | None = None) -> dict[str, str]:
    """The CUDA source of each warpgroup role (the branches start with their setmaxnreg call, ``marks``: by default
    the variant's)."""
    marks = marks or _role_marks(variant)
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
@pytest.mark.parametrize("transposed", [False, True])
def test_register_budgets_fit_the_launch(fp8, transposed):
    """setmaxnreg takes multiples of 8 in 24..256, and the roles share the registers per thread slot the CTA was
    launched with (3 x 168 at 384 threads; tws fp8's 2 producers: 4 x 128), more is an illegal instruction."""
    wg0, wg1, producer = budget = ws.register_budget(fp8, transposed)
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

    budget = ws.smem_budget(rs_pv=True)
    # Exactly the sum of the buffers: TileLang merged no two of them (its liveness analysis is
    # sequential and would not know that the roles run concurrently).
    assert smem == budget["dynamic"], f"dynamic shared memory {smem} B, the budget says {budget}"
    assert smem + budget["static"] <= SM90_SMEM_LIMIT
    # 8 arrays for the pipeline's 10 barriers
    assert len(re.findall(r"\b(uint64_t) \w+_mem\[", src)) == 8, "expected 8 mbarrier arrays (10 barriers)"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_producer_reads_page_ids_before_the_buffer_wait(dtype):
    """A 16-bit cache's producer reads a block's page ids into its page registers before it waits for the block's
    buffer (k_free), so that the page table's latency overlaps the wait instead of delaying the copies; the registers
    are read by the copies (TileLang 0.1.11's CUDA codegen crashed on an unused local buffer)."""
    for page_size in (64, 16):
        script = sm90.build_decode_kernel(16, 1, page_size, dtype, dtype, cfg=configs.SM90).script()
        loop = script[script.index("pages[r] = page_table[") - 400:]
        read, wait = loop.index("pages[r] = page_table["), loop.index("T.mbarrier_wait_parity(k_free")
        assert read < wait, page_size
        assert ("pages[0]" if page_size == 64 else "pages[r]") in loop[wait:], page_size


def check_named_barriers_role_local(src: str, variant, marks: dict[str, str] | None = None) -> dict[str, str]:
    """A __syncthreads() after the role split, a named barrier shared by two roles, or one inside a
    thread-dependent branch of a role would deadlock or mis-synchronise. Returns the role sections (``marks``: each
    role's setmaxnreg call, by default the variant's)."""
    marks = marks or _role_marks(variant)
    first_role = min(src.index(m) for m in marks.values())
    assert "__syncthreads()" not in src[first_role:], "CTA-wide barrier inside a warp role"
    role_conditions = ("((int)threadIdx.x) < 128", "((int)threadIdx.x) < 256")
    ids_by_role = {}
    sections = _role_sections(src, variant, marks)
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
    if variant[4] != variant[3]:
        # fp8: each producer thread converts its own rows and no producer thread reads another's; with the stores'
        # addresses visible TileLang 0.1.9 put 0 or 20 named barriers among the producer's warps per block, by compile
        assert not list(named_barriers(sections["producer"])), "named barrier among the fp8 producer's warps"


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
    reads = [m.start() for name in ("part_start", "req_parts", "cu_blocks", "part_begin_req", "part_end_req", "kv_lens",
                                    "qo_indptr", "page_table", "page_table_start", "k_scale", "sm_scale", "q_nope",
                                    "q_pe") for m in [re.search(rf"\b{name}\[", body)] if m]
    assert reads and wait < min(reads) and "cudaTriggerProgrammaticLaunchCompletion" not in body
    assert "tma_load" not in body[:wait]  # (a descriptor's prefetch may come first: descriptors are parameters)


def test_whole_blocks_arrive_by_tma(lowered):
    """16-bit cache, page size a multiple of 64, an even number of row blocks (cluster_kv):
    the two row-block CTAs of a part are a cluster; of a whole block, rank 0's producer issues the left tile's four
    64 x 64 boxes and rank 1's the right tile's, and rank g % 2 the rope box of block g (cluster_rope),
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
    assert re.search(r"if \(part_hi < part_lo\) \{\s*if \(tl::tl_shuffle_elect<128>\(\)\) \{\s*"
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
    for variant in [(128, 2, 1, "bfloat16", "bfloat16"), (32, 1, 64, "bfloat16", "float8_e4m3")]:
        assert "tma_load(kv_cache_desc" not in lowered[variant][0], variant
        assert "cluster_sync" not in lowered[variant][0], variant


def test_clusters_only_for_an_even_number_of_row_blocks():
    """cluster_kv pairs row blocks 2i and 2i + 1 of a part: the variants with 2 or 4 row blocks and TMA blocks get the
    multicast; one row block (h x q_len <= 64), page sizes below 64 and fp8 caches do not."""
    cfg = configs.SM90
    for variant, paired in [((128, 1, 64, "bfloat16", "bfloat16"), True), ((64, 2, 64, "float16", "float16"), True),
                            ((128, 2, 128, "bfloat16", "bfloat16"), True), ((64, 1, 64, "bfloat16", "bfloat16"), False),
                            ((32, 2, 64, "bfloat16", "bfloat16"), False), ((128, 1, 16, "bfloat16", "bfloat16"), False),
                            ((128, 1, 64, "bfloat16", "float8_e4m3"), False)]:
        assert ('"MLA_TMA_MC"' in sm90.build_decode_kernel(*variant, cfg=cfg).script()) == paired, variant


# A shared-memory address in TileLang's CUDA: ``(&(((bfloat16_t*)BASE)[INDEX]))``, BASE the dynamic shared memory
# itself (``buf_dyn_shmem``, 0.1.9) or a named buffer declared at an offset into it (0.1.11 and newer:
# ``void* p_shared = ((void*)((char*)buf_dyn_shmem + 212992));``).
SMEM_ADDRESS = r"\(&\(\(\((\w+)\*\)(\w+)\)\[(\d+)\]\)\)"
_ELEMENT_BYTES = {"bfloat16_t": 2, "half_t": 2, "float": 4, "int": 4, "uchar": 1, "fp8_e4_t": 1}


def smem_byte_offset(src: str, element: str, base: str, index: str) -> int:
    """The byte offset into the dynamic shared memory of an address ``SMEM_ADDRESS`` matched in ``src``."""
    start = 0
    if base != "buf_dyn_shmem":
        decl = re.search(rf"\b{base} = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\);", src)
        assert decl, f"{base}: not a buffer in the dynamic shared memory"
        start = int(decl.group(1))
    return start + int(index) * _ELEMENT_BYTES[element]


def test_smem_byte_offset_reads_both_forms():
    src = "  void* p_shared = ((void*)((char*)buf_dyn_shmem + 212992));\n"
    for text, offset in [("(&(((bfloat16_t*)buf_dyn_shmem)[106496]))", 212992),
                         ("(&(((bfloat16_t*)p_shared)[0]))", 212992), ("(&(((float*)p_shared)[8]))", 213024)]:
        assert smem_byte_offset(src, *re.fullmatch(SMEM_ADDRESS, text).groups()) == offset, text


def test_wg0_multiplies_p_from_registers(lowered):
    """rs_pv (default): WG0's P V is an RS WGMMA; P goes to shared memory by mla_store_p64, which writes the
    128-byte-swizzled K-major tile that WG1's descriptor for that address names (layout type 1), and WG0's block
    loop has no named barrier (only the segment's start and epilogue do)."""
    variant = (128, 1, 64, "bfloat16", "bfloat16")
    src = lowered[variant][0]
    sections = _role_sections(src, variant)
    wg0, wg1 = sections["wg0"], sections["wg1"]
    assert "tl::wgmma_rs<" in wg0 and "tl::wgmma_rs<" not in wg1
    stores = {smem_byte_offset(src, *m) for m in re.findall(rf"mla_store_p64\({SMEM_ADDRESS}, p_frag\)", wg0)}
    assert len(stores) == 1, stores
    swizzled = {smem_byte_offset(src, *m)
                for m in re.findall(rf"initialize_wgmma_descriptor<1, 1, 64>\(desc_\w+, {SMEM_ADDRESS}\)", wg1)}
    assert stores <= swizzled, f"WG1 does not read P (byte {stores}) as the 128-byte-swizzled tile: {swizzled}"
    assert "mla_store_rows64(" in wg0
    # none in the block loop: the segment's start and the l hand-off have one each
    assert len(list(named_barriers(wg0))) == 2


def test_wg0_follows_fa3_order():
    """ws WG0 per block: the wait for WG1's release of P right after S (pfree_early), O's rescale before P's exp2s
    (rescale_early), and its own P V issued before the fence and p_ready that hand P to WG1 (pv_early)."""
    src = sm90.build_decode_kernel(128, 2, 64, "bfloat16", "bfloat16", cfg=configs.SM90).script()

    def at(pattern):
        found = re.search(pattern, src)
        assert found, pattern
        return found.start()

    row_max, exp = at(r"mla_row_max2"), at(r"T\.exp2\(acc_s\[i, j\]")
    pfree_wait = at(r"mbarrier_wait_parity\(p_free\w*\[0\]")
    rescale = at(r"acc_o_l\[i, d\] = acc_o_l\[i, d\] \* alpha\[i\]")
    wg0_pv, p_ready = at(r"wgmma_gemm\(T\.region\(p_frag"), at(r"ptx_arrive_barrier\(p_ready\w*\[0\]\)")
    assert pfree_wait < row_max and rescale < exp and wg0_pv < p_ready


def test_block_trace_is_off_by_default_and_calls_nothing():
    """KernelConfig.trace_part (scripts/trace_blocks.py): off in every shipped config, no trace code then; on, each
    role records its steps inline (no function call: ptxas would serialise the WGMMAs) into the unused last slot."""
    assert all(cfg.trace_part < 0 for cfg in configs.CONFIGS.values())
    variant = (128, 2, 64, "bfloat16", "bfloat16")
    plain = sm90.build_decode_kernel(*variant, cfg=configs.SM90).script()
    traced = sm90.build_decode_kernel(*variant, cfg=dataclasses.replace(configs.SM90, trace_part=3)).script()
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
    threads = _threads(variant)
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\({threads}, 1\) mla_decode_split_kernel', src)
    shapes = set(re.findall(r"tl::wgmma_ss<[^>]*?kFloat32, (\d+), (\d+), (\d+), (true|false), (true|false)", src))
    assert shapes == {("64", "16", "16", "false", "false"), ("64", "16", "16", "true", "false")}, shapes
    for mark in _role_marks(variant).values():
        assert mark in src
    sections = check_named_barriers_role_local(src, variant)
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
    assert smem == ws.smem_budget(transposed=True)["dynamic"], f"dynamic shared memory {smem} B"
    # 8 arrays for the pipeline's 10 barriers
    assert len(re.findall(r"\b(uint64_t) \w+_mem\[", src)) == 8, "expected 8 mbarrier arrays (10 barriers)"


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
    threads = _threads(variant)
    assert int(regs.group(1)) <= ws.launch_regs(threads), report
    # no spills, and no stack (a register array with a thread-dependent index lands in local memory)
    assert spills.groups() == ("0", "0", "0"), f"local memory: {spills.group(0)}"
    ptx = "".join(p.read_text() for p in keep.glob("*.ptx"))
    assert "wgmma.mma_async" in ptx, "no WGMMA in the PTX"
    budget = _budget(variant)
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


def test_transposed_exactly_where_the_rows_fit_one_tile():
    """The consumers transpose (S^T = K Q^T, m64n16) where h x q_len <= 16; other shapes get 64-row blocks."""
    for variant, transposed in [((16, 1, 64, "bfloat16", "bfloat16"), True), ((5, 2, 1, "float16", "float16"), True),
                                ((8, 2, 64, "bfloat16", "float8_e4m3"), True), ((32, 1, 64, "bfloat16", "bfloat16"), False),
                                ((16, 2, 16, "float16", "float8_e4m3"), False)]:
        assert sm90.variant_spec(*variant).transposed is transposed, variant
