"""The Hopper decode's shapes, register budgets, shared-memory budget, CUDA prelude and barrier protocol.

Everything here is plain Python on ints or TIR expressions: the kernel (kernel.py and its role modules) computes
every barrier index and parity with these functions, and tests/test_lowering_ws.py runs the same functions (on ints)
in a simulation of the three roles.
"""

from importlib import resources

from ...constants import HEAD_DIM, KV_LORA_RANK

HALF = KV_LORA_RANK // 2  # output columns per consumer warpgroup


# setmaxnreg budgets, multiples of 8. setmaxnreg moves registers between the warpgroups of a CTA, whose
# pool is what it was launched with: 384 threads x 168 (launch bound). A sum above 3 x 168 = 504 per
# thread slot, or a setmaxnreg.inc below the launch count, is an illegal instruction at run time.
REGS_PER_SM = 65536


def launch_regs(threads: int = 384) -> int:
    """Registers per thread the launch bound leaves (a multiple of 8): 168 at 384 threads, 128 at 512."""
    return REGS_PER_SM // threads // 8 * 8


LAUNCH_REGS = launch_regs(384)
REGS_PER_CTA_SLOT = 3 * LAUNCH_REGS
REGS_WG0, REGS_WG1, REGS_PRODUCER = 240, 168, 80
# fp8 cache: the producer holds 2 rows x 144 B of raw bytes per thread (72 registers: one row's loads in
# flight while the other converts); WG1 needs fewer there (it peaks at R153): 240 + 160 + 104 = 504.
REGS_WG1_FP8, REGS_PRODUCER_FP8 = 160, 104
# tws, fp8 cache: the transposed consumers need few registers (ptxas: R97 / R63), so TWS_FP8_PRODUCERS producer
# warpgroups take blocks in turn, each with one set of raw
# registers (its 2 rows of a block, 72 registers): a block's loads are issued when its producer has converted
# the block TWS_FP8_PRODUCERS before, so they have that many blocks' time to land, less one conversion. One
# warpgroup with two sets cannot do that: ptxas counts all of a thread's loads on one scoreboard, so each
# conversion waits for every load the thread has in flight and the next block's loads get one block's time.
# Not 3: over two buffers a producer could then wait for k_free's completion f - 1 while it is at f - 3 (its
# buffer's fills in between are another producer's), which a parity wait cannot tell apart (tests/test_lowering_ws.py).
TWS_FP8_PRODUCERS = 2
REGS_TWS_FP8_RR = (120, 80, 152)  # 4 x 128 registers per thread slot at 512 threads
# fp8 compute (fp8c.py): WG1's 128 accumulators and the 8 A registers of its RS WGMMAs in flight do not fit 160 (ptxas
# then serialises every WGMMA of the kernel, C7512); the producer, which converts nothing, peaks at R85.
REGS_FP8C = (240, 168, 96)


def kernel_threads(fp8: bool, transposed: bool) -> int:
    """Threads of a variant: two consumer warpgroups and one producer, or tws fp8's TWS_FP8_PRODUCERS."""
    return 256 + 128 * (TWS_FP8_PRODUCERS if fp8 and transposed else 1)


def register_budget(fp8: bool, transposed: bool = False, fp8c: bool = False) -> tuple[int, int, int]:
    """setmaxnreg of (WG0, WG1, producer) for a kernel variant (``transposed``: tws with h x q_len <= 16; each of
    tws fp8's producer warpgroups gets the producer's; ``fp8c``: the fp8-compute ws kernel)."""
    if fp8c:
        return REGS_FP8C
    if transposed and fp8:
        return REGS_TWS_FP8_RR
    return (REGS_WG0, REGS_WG1_FP8, REGS_PRODUCER_FP8) if fp8 else (REGS_WG0, REGS_WG1, REGS_PRODUCER)


def grows(count: int, threads: int = 384) -> int:
    """setmaxnreg direction for a role's budget: 1 (.inc) from the launch count up, 0 (.dec) below it.
    The direction of a role depends on the variant."""
    return 1 if count >= launch_regs(threads) else 0


# Named barrier of WG0's one explicit bar.sync; TileLang numbers its own from 3 up, one per thread range
# (its cross-warp reductions, tws only, use 1 and 2).
WG0_NAMED_BARRIER = 15

# tws ("transposed"): where the rows (h x q_len) fit in TWS_COLS, the consumers compute S^T = K Q^T with the 64
# KV tokens as WGMMA's M and the rows as N (m64n16), and O^T = V^T P^T, instead of padding the rows to M = 64:
# a quarter of the tensor work, of the Q tile and of its shared-memory reads. Softmax runs down the columns.
TWS_COLS = 16
TWS_TILE = 64  # output dims per WGMMA (M) tile of O^T

SMEM_LIMIT_SM90 = 232448  # bytes of shared memory one block may opt into on H100 / H200

# A bf16 q read by the fp16 (fp8-cache) kernel is stored as fp16 x 2^-Q_F16_SHIFT.
Q_F16_SHIFT = 8
# The fp8-compute kernel (fp8c.py) stores P in e4m3 times P8_SCALE: P <= 1, and 256 keeps most of it above e4m3's
# subnormal range (2^-6); the epilogue divides it out.
P8_SCALE = 256.0

# Device helpers pasted into the generated CUDA (T.Kernel prelude). Among them, e4m3 -> bf16 / fp16: put each byte in
# the high byte of a 16-bit lane, move exponent + mantissa down into the target's fields (sign stays); the value is
# then x * 2^-(target bias - 7) for normal and subnormal e4m3 alike, so one multiply by 2^120 (bf16) / 2^8 (fp16)
# restores it exactly. The text is prelude.cuh, shipped as package data, with its
# MLA_* placeholders filled in from the constants above.
def _load_prelude() -> str:
    text = resources.files(__package__).joinpath("prelude.cuh").read_text()
    return ("\n" + text).replace("MLA_Q_F16_SCALE", f"{2.0 ** -Q_F16_SHIFT!r}f")


PRELUDE = _load_prelude()

# KernelConfig.trace_part: clock64 per (role, block g < 64, step) of one program (row block 0), written to the last
# slot of out_partial, which no plan uses (slots go up to num_parts + batch - 2): int64 [role][g][step], then per role
# its first step's clock and %globaltimer (ns) and its last clock and ns. Roles: 0 WG0, 1 WG1, 2 the producer; steps as
# the trace() calls name them. No printf: a function call in the kernel makes ptxas serialise every WGMMA.
TRACE_ROLES, TRACE_BLOCKS, TRACE_STEPS = 3, 64, 8
TRACE_HEAD = TRACE_ROLES * TRACE_BLOCKS * TRACE_STEPS  # where the per-role (clock, ns, clock, ns) words start
TRACE_WORDS = TRACE_HEAD + TRACE_ROLES * 4
# The fp8-compute kernel's segment stamps, on a segment's first block past the per-block steps: WG0 before its wait for
# Q8 (the previous segment's epilogue done), WG1 once WG0's l has come (its epilogue's start); the producer at
# SEG_TRACE_STEP - 2 .. SEG_TRACE_STEP: before its wait for q_free, after it, and after Q8's q_ready.
SEG_TRACE_STEP = TRACE_STEPS - 1
TRACE_PRELUDE = r'''
__device__ long long* mla_trace_out[MLA_TRACE_ROLES];
__device__ __forceinline__ bool mla_traced() {
  return blockIdx.x == MLA_TRACE_PART && blockIdx.y == 0 && threadIdx.x % 128 == 0;
}
__device__ __forceinline__ long long mla_trace_ns() {
  long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}
__device__ __forceinline__ void mla_trace_begin(float* last_slot) {
  if (!mla_traced()) return;
  const int role = threadIdx.x / 128;
  long long* out = reinterpret_cast<long long*>(last_slot);
  mla_trace_out[role] = out;
  out[MLA_TRACE_HEAD + role * 4] = clock64();
  out[MLA_TRACE_HEAD + role * 4 + 1] = mla_trace_ns();
}
__device__ __forceinline__ void mla_trace(int role, int g, int step) {
  if (mla_traced() && g < MLA_TRACE_BLOCKS)
    mla_trace_out[role][(role * MLA_TRACE_BLOCKS + g) * MLA_TRACE_STEPS + step] = clock64();
}
__device__ __forceinline__ void mla_trace_end(int role) {
  if (!mla_traced()) return;
  mla_trace_out[role][MLA_TRACE_HEAD + role * 4 + 2] = clock64();
  mla_trace_out[role][MLA_TRACE_HEAD + role * 4 + 3] = mla_trace_ns();
}
'''



def trace_prelude(part: int) -> str:
    """TRACE_PRELUDE for program ``part`` (row block 0), with the record's layout constants filled in."""
    text = TRACE_PRELUDE
    for name, value in (("PART", part), ("ROLES", TRACE_ROLES), ("BLOCKS", TRACE_BLOCKS), ("STEPS", TRACE_STEPS),
                        ("HEAD", TRACE_HEAD)):
        text = text.replace(f"MLA_TRACE_{name}", str(value))
    return text


# Blocks ahead of the one being loaded whose rows the fp8 producer asks L2 for.
FP8_PREFETCH_AHEAD = 2


def smem_budget(block_rows: int = 64, block_n: int = 64, elem_bytes: int = 2, transposed: bool = False,
                rs_pv: bool = False, fp8c: bool = False) -> dict:
    """Shared-memory bytes of the warp-specialised kernel (the docstring's table).

    ``dynamic`` is what TileLang allocates (``dyn_shared_memory_buf``); the mbarriers are static
    ``__shared__`` arrays, which nvcc pads to 1024 B so that the 1024-aligned dynamic buffer follows.
    ``transposed`` (tws): Q and P have TWS_COLS rows, plus 128 floats each for the column max exchange
    (``mla_colmax4``, two halves by block parity) and TileLang's scratch for the column sums. ``rs_pv``: two
    alpha slots instead of one. ``fp8c`` (the fp8-compute ws kernel): Q, the KV buffers and P in e4m3, two alpha
    slots, and each Q row's scale.
    """
    if fp8c:
        elem_bytes, rs_pv = 1, True
    q_rows = TWS_COLS if transposed else block_rows
    parts = {
        "q": q_rows * HEAD_DIM * elem_bytes,
        "kv": 2 * block_n * HEAD_DIM * elem_bytes,
        "p": q_rows * block_n * elem_bytes,
        "alpha_l": (3 if rs_pv and not transposed else 2) * q_rows * 4,
    }
    if fp8c:
        parts["qscale"] = q_rows * 4
    if transposed:
        parts["reduce"] = 2 * 128 * 4
    parts["dynamic"] = sum(parts.values())
    parts["static"] = 1024
    parts["total"] = parts["dynamic"] + parts["static"]
    return parts


# ---------------------------------------------------------------- pipeline protocol
# The kernel computes every barrier index and parity with these functions (on TIR expressions), and
# tests/test_lowering_ws.py runs the same functions (on ints) in a simulation of the three roles.
# g: a block's index inside the part (0, 1, 2, ... across request boundaries); s: the index of a
# non-empty request segment inside the part. A wait for completion n of a barrier uses parity n & 1;
# waiting for completion n - 1 = -1 (parity 1) passes at once on a fresh barrier.

def kv_buffer(g):
    """Which of the two KV buffers block g uses."""
    return g & 1


def kv_ready_parity(g):
    """Consumers of block g wait for completion g >> 1 of k_ready[g & 1] (its (g >> 1)-th fill)."""
    return (g >> 1) & 1


def kv_free_parity(g):
    """The producer, before filling block g, waits for completion (g >> 1) - 1 of k_free[g & 1]."""
    return ((g >> 1) & 1) ^ 1


def alpha_slot(g):
    """rs_pv: the shared slot (of two) WG0 stores block g's alpha in, before it waits for p_free."""
    return g & 1


def p_ready_parity(g):
    """WG1 waits for completion g of p_ready (P and alpha of block g written)."""
    return g & 1


def p_free_parity(g):
    """WG0, before writing P(g), waits for completion g - 1 of p_free (WG1 done with P(g - 1))."""
    return (g & 1) ^ 1


def seg_ready_parity(s):
    """q_ready / l_ready: wait for completion s (this segment's Q loaded / l written)."""
    return s & 1


def seg_free_parity(s):
    """q_free / l_free: wait for completion s - 1 (the previous segment's Q / l no longer read)."""
    return (s & 1) ^ 1


# Each KV buffer is three tiles (rope, left 256 dims, right 256 dims); with tile_ready each has its own k_ready.
PART_T, PART_L, PART_R = 0, 1, 2
N_PARTS = 3


def part_barrier(g, part):
    """Index of the k_ready barrier of tile ``part`` of the buffer holding block g (tile_ready)."""
    return kv_buffer(g) * N_PARTS + part


def segment_first_block(part_lo, req_lo, blk_lo):
    """g of a request segment's first block: its flat block index minus the part's first one."""
    return req_lo + blk_lo - part_lo

