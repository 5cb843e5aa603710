"""Warp-specialised TileLang MLA decode for Hopper (FlashMLA-style), same contract as ``mla_decode``.

Drop-in alternative to :func:`mla_backend.kernels.mla_decode.build_decode_kernel`: same prim_func
name, same argument list and order, same plan semantics (parts over the flattened (request, block)
list, ``blocks_per_part``, direct write when a request lies in one part, partial slot ``part + req``,
log2 partial LSE, natural-log final LSE, zeros / -inf for rows that see nothing, causal rule
``pos < kv_len - q_len + row // num_heads + 1``, fp8 scale folded into S and O, clamped tail reads).
The only difference visible to the host is the KV block size: 64 tokens, so the split planner must
be built with ``block_n=SM90_WS.block_n`` (64) when this kernel is used. The combine kernel of
``mla_decode`` is reused unchanged (it does not depend on the block size).

Layout of one program (part, 64-row block), 384 threads = 3 warpgroups (tws with an fp8 cache: 512, two
producer warpgroups taking blocks in turn, ``TWS_FP8_PRODUCERS``):

* WG0 (threads 0..127, 240 regs), consumer 0: ``S = Q K^T`` over 576 dims (WGMMA, async + wait),
  length / causal mask, online softmax (log2 domain, -inf safe), P (bf16/fp16) and the per-row
  rescale ``alpha`` to shared memory, then ``O[:, :256] += P V[:, :256]`` (``rs_pv``, the default: P from
  registers, the GEMM issued before P's shared copy is handed to WG1; alpha in one of two slots).
* WG1 (threads 128..255, 168 regs), consumer 1: ``O[:, 256:] = alpha * O[:, 256:] + P V[:, 256:]``
  from P in shared memory.
* WG2 (threads 256..383, 80 regs), producer: gathers each 64-token KV block through the page table
  into one of two shared buffers (cp.async, or for an fp8 cache: load, convert to fp16 in registers,
  store), and each request segment's Q tile into the Q buffer.

Shared memory (bytes; the Hopper per-block limit is 232448 = 227 KiB, static + dynamic):

    Q          64 x 576 x 2             73728
    KV x 2     2 x 64 x 576 x 2        147456
    P          64 x 64 x 2               8192
    alpha x 2, l  3 x 64 x 4              768   (rs_pv; without it one alpha: 512)
    m, ticket  64 x 4 + 16                272   (merge_pairs: WG0's row max for WG1, the merge ticket)
    dynamic                            230416   (TileLang's dyn_shared_memory_buf)
    mbarriers  12 x 8, static            1024   (10 + merge_pairs' 2; nvcc pads static shared to the 1 KiB alignment
                                                 of the dynamic buffer)
    total                              231440   (1008 B to spare)

There is no room for a separate fp8 staging tile (64 x 576 x 1 = 36864 B), so for an fp8 cache the
producer loads with plain loads and converts in registers; the per-tensor ``k_scale`` is applied to S
(through the softmax scale) and to O, as in ``mla_decode``. With an fp8 cache the ws kernel computes in
fp16 whatever q's dtype: e4m3 -> fp16 is one hardware instruction per pair (``cvt.rn.f16x2.e4m3x2``;
bf16 would take five), exact, and a bf16 q becomes fp16 x 2^-8 in shared memory (exact unless below
2^-6, where the absolute error stays under 2^-17; overflow only above 2^24), the 2^8 undone in the
softmax scale; P in fp16 is finer than in bf16. The output keeps q's dtype. The producer streams rows:
it holds two rows per thread and keeps one row's 9 loads in flight while converting the other (the
next block's first row during this block's second), issues a block's loads before waiting for its
buffer, and first asks L2 for the rows of the block two ahead (``prefetch.global.L2``). The tws producer
(whose consumers leave it 240 registers) holds 4 rows: the next block's two load while this block's two
convert, issued after this block's first conversion (one scoreboard counts all of a thread's loads), and
asks L2 for nothing past a segment's first two blocks (docs/kernel-ws.md). With TWS_FP8_PRODUCERS = 2 (the
default) the tws fp8 kernel has 512 threads: two producer warpgroups take blocks in turn, each converting
from one row set and then issuing its next block's loads, which so have two blocks' time to land. Under
MLA_BACKEND_SM90_KERNEL=seesaw an fp8 cache compiles this ws kernel (the seesaw schedule is 16-bit only).

Synchronisation (mbarriers; arrive counts in threads). ``g`` is the block's index inside the part
(``flat block - part * blocks_per_part``: a running counter that carries across requests, so the
pipeline does not drain at a request boundary and a segment may have any number of blocks, odd
included); ``s`` counts the non-empty request segments the program has started. A wait on parity
``(n & 1) ^ 1`` waits for completion ``n - 1`` and passes at once on a fresh barrier (``n = 0``).

    barrier        count  arrived by                      waited by (parity)
    k_ready[b]      128   WG2, cp.async noinc / arrive    WG0, WG1 for block g (b = g & 1): (g >> 1) & 1
    k_free[b]       256   WG0 + WG1 after block g         WG2 before filling block g: ((g >> 1) & 1) ^ 1
                   (+8)   cluster_kv: lane 0 of each consumer warp of the pair's other CTA, after block g
    q_ready         128   WG2, cp.async noinc             WG0 before segment s's first S: s & 1
    q_free          128   WG0 after segment s's last S    WG2 before loading Q of segment s: (s & 1) ^ 1
    p_ready         128   WG0 after writing P, alpha(g)   WG1 for block g: g & 1
    p_free          128   WG1 after reading P, alpha(g)   WG0 before writing P(g): (g & 1) ^ 1
                                                          (rs_pv: alpha(g) goes to slot g & 1 before that wait)
    l_ready         128   WG0 after writing l (segment s) WG1 at the end of segment s: s & 1
    l_free          128   WG1 after reading l (segment s) WG0 before writing l(s): (s & 1) ^ 1

A request the plan cuts into two parts (``merge_pairs``, the default) is merged by the second of its two programs to
finish, per row block: at the segment's end thread 0 takes a ticket from the request's counter (``plan.merge_count``)
and publishes it to both consumers through a one-arrival mbarrier per ticket slot; the first stores its partial and,
after named barrier 13 (the consumers' 256 threads), adds 1 << 16, the second
waits for that (``ld.acquire``), adds the other partial to its own normalised O by LSE (the same rounding either way
round), writes out / lse and resets the counter. Requests of more parts and empty ones are left to the combine.

docs/kernel-ws.md walks through the phases (request boundary, odd block count, empty segment, a part
that touches several requests); tests/test_lowering_ws.py simulates them for random plans.
"""

import tilelang.language as T

from .configs import SM90_WS, KernelConfig, merged_parts
from .mla_decode import (HEAD_DIM, KV_LORA_RANK, LN2, LOG2E, ROPE_DIM, SegmentStore, make_store_rows, num_row_blocks,
                         partial_lse, request_parts, wait_for_inputs)

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
# seesaw: both consumers hold an S tile, P and half of O (224 + 224 + 56 = 504; no spills with bf16); its producer
# only issues cp.async
REGS_SEESAW, REGS_SEESAW_PRODUCER = 224, 56
# tws, fp8 cache: the transposed consumers need few registers (ptxas: R97 / R63), so the producer takes them and
# holds 4 rows of raw bytes (144 registers): the next block's two rows load while this block's two convert.
REGS_TWS_FP8 = (160, 104, 240)
# tws, fp8 cache, TWS_FP8_PRODUCERS > 1 producer warpgroups taking blocks in turn, each with one set of raw
# registers (its 2 rows of a block, 72 registers): a block's loads are issued when its producer has converted
# the block TWS_FP8_PRODUCERS before, so they have that many blocks' time to land, less one conversion. One
# warpgroup with two sets cannot do that: ptxas counts all of a thread's loads on one scoreboard, so each
# conversion waits for every load the thread has in flight and the next block's loads get one block's time.
# Not 3: over two buffers a producer could then wait for k_free's completion f - 1 while it is at f - 3 (its
# buffer's fills in between are another producer's), which a parity wait cannot tell apart (tests/test_lowering_ws.py).
TWS_FP8_PRODUCERS = 2
REGS_TWS_FP8_RR = (120, 80, 152)  # 4 x 128 registers per thread slot at 512 threads


def kernel_threads(fp8: bool, transposed: bool) -> int:
    """Threads of a variant: two consumer warpgroups and one producer, or tws fp8's TWS_FP8_PRODUCERS."""
    return 256 + 128 * (TWS_FP8_PRODUCERS if fp8 and transposed else 1)


def register_budget(fp8: bool, seesaw: bool = False, transposed: bool = False) -> tuple[int, int, int]:
    """setmaxnreg of (WG0, WG1, producer) for a kernel variant (``transposed``: tws with h x q_len <= 16; each of
    tws fp8's producer warpgroups gets the producer's)."""
    if seesaw:
        return REGS_SEESAW, REGS_SEESAW, REGS_SEESAW_PRODUCER
    if transposed and fp8:
        return REGS_TWS_FP8 if TWS_FP8_PRODUCERS == 1 else REGS_TWS_FP8_RR
    return (REGS_WG0, REGS_WG1_FP8, REGS_PRODUCER_FP8) if fp8 else (REGS_WG0, REGS_WG1, REGS_PRODUCER)


def grows(count: int, threads: int = 384) -> int:
    """setmaxnreg direction for a role's budget: 1 (.inc) from the launch count up, 0 (.dec) below it.
    The seesaw consumers always grow; the other roles' direction depends on the variant."""
    return 1 if count >= launch_regs(threads) else 0


# Named barrier of WG0's one explicit bar.sync; TileLang numbers its own from 3 up, one per thread range
# (its cross-warp reductions, tws only, use 1 and 2).
WG0_NAMED_BARRIER = 15
# Named barrier of both consumer warpgroups (threads 0..255) in the epilogue of a request merged in the kernel.
MERGE_NAMED_BARRIER = 13
# A request's merge counter: tickets in the low 16 bits, partials stored (1 << MERGE_DONE_SHIFT each) above.
MERGE_DONE_SHIFT = 16
# 8-byte loads of a partial in flight per thread of a merging warpgroup (WG1 holds 128 accumulator registers of 168)
MERGE_LOADS = 8

# tws ("transposed"): where the rows (h x q_len) fit in TWS_COLS, the consumers compute S^T = K Q^T with the 64
# KV tokens as WGMMA's M and the rows as N (m64n16), and O^T = V^T P^T, instead of padding the rows to M = 64:
# a quarter of the tensor work, of the Q tile and of its shared-memory reads. Softmax runs down the columns.
TWS_COLS = 16
TWS_TILE = 64  # output dims per WGMMA (M) tile of O^T

SMEM_LIMIT_SM90 = 232448  # bytes of shared memory one block may opt into on H100 / H200

# A bf16 q read by the fp16 (fp8-cache) kernel is stored as fp16 x 2^-Q_F16_SHIFT.
Q_F16_SHIFT = 8

# Device helpers pasted into the generated CUDA (T.Kernel prelude).
# e4m3 -> bf16 / fp16: put each byte in the high byte of a 16-bit lane, move exponent + mantissa down
# into the target's fields (sign stays); the value is then x * 2^-(target bias - 7) for normal and
# subnormal e4m3 alike, so one multiply by 2^120 (bf16) / 2^8 (fp16) restores it exactly.
PRELUDE = r'''
// tws WG0: running column max of S^T [64 tokens, 16 rows] over a block, the four columns of a thread in one
// exchange. s: the thread's 8 values of S^T in the m64n16 accumulator layout (index (c >> 1) * 4 + (c & 1) + 2 * k
// holds column c of token row k); m: its 4 column maxima, updated; scratch: 2 x 64 floats (block parity).
__device__ __forceinline__ void mla_colmax4(const float* s, float* m, float* scratch, int parity) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  float v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    float x = fmaxf(s[(c >> 1) * 4 + (c & 1)], s[(c >> 1) * 4 + (c & 1) + 2]);
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
    v[c] = x;
  }
  float* buf = scratch + parity * 64;
  if (lane < 4) *reinterpret_cast<float4*>(buf + warp * 16 + lane * 4) = make_float4(v[0], v[1], v[2], v[3]);
  asm volatile("bar.sync 1, 128;" ::: "memory");
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 o = *reinterpret_cast<const float4*>(buf + w * 16 + (lane & 3) * 4);
    m[0] = fmaxf(m[0], o.x); m[1] = fmaxf(m[1], o.y); m[2] = fmaxf(m[2], o.z); m[3] = fmaxf(m[3], o.w);
  }
}
__device__ __forceinline__ void mla_l2_prefetch(const void* ptr) {  // the 128-byte line holding ptr
  asm volatile("prefetch.global.L2 [%0];" :: "l"(ptr));
}
// 16 bytes global -> registers. volatile, like the multiplies below: ptxas keeps volatile asm in program
// order, so every load of a pass is issued before the first conversion (it interleaves them otherwise).
__device__ __forceinline__ void mla_ldg16(void* dst, const void* src) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src));
  *reinterpret_cast<uint4*>(dst) = v;
}
template <bool kBF16>
__device__ __forceinline__ unsigned mla_e4m3x2(unsigned word, unsigned selector) {
  unsigned t = __byte_perm(word, 0u, selector);  // [0, b_lo, 0, b_hi]
  unsigned v = (t & 0x80008000u) | ((t & 0x7F007F00u) >> (kBF16 ? 4 : 1));
  unsigned r;
  if (kBF16) asm volatile("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x7B807B80u));
  else asm volatile("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(0x5C005C00u));
  return r;
}
// fp16: the hardware conversion (sm_89+), one instruction per pair; the low byte goes to the low half.
__device__ __forceinline__ void mla_e4m3x4_f16(unsigned word, unsigned& lo, unsigned& hi) {
  asm volatile("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\n"
               "cvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}"
               : "=r"(lo), "=r"(hi) : "r"(word));
}
// ws WG0 (rs_pv): stores by plain address, so TileLang's thread-sync pass adds no barrier around them.
// The m64 accumulator layout gives thread t of the warpgroup rows (t / 32) * 16 + (t % 32) / 4 and that + 8:
// one thread of each quad stores its two row values (alpha) at dst.
__device__ __forceinline__ void mla_store_rows64(float* dst, const float* v) {
  const int t = threadIdx.x & 127;
  if ((t & 3) == 0) {
    const int r = (t >> 5) * 16 + ((t & 31) >> 2);
    dst[r] = v[0];
    dst[r + 8] = v[1];
  }
}
// This thread's share of the row sums of a 64 x 64 m64n64 accumulator tile (its rows lane / 4 and lane / 4 + 8, 16
// columns each); the quad's other three threads hold the rest, added once per segment by mla_quad_sum2.
__device__ __forceinline__ void mla_row_sum_part(const float* s, float* out) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float a = 0.0f;
#pragma unroll
    for (int c = 0; c < 16; ++c) a += s[(c & 7) * 4 + i * 2 + (c >> 3)];
    out[i] = a;
  }
}
// v[0..1] summed over the quad (lanes 4k .. 4k + 3 share the rows); every lane ends with the same bits, as
// (a + b) + (c + d) is formed the same way on each.
__device__ __forceinline__ void mla_quad_sum2(float* v) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[i] += __shfl_xor_sync(0xffffffffu, v[i], 1);
    v[i] += __shfl_xor_sync(0xffffffffu, v[i], 2);
  }
}
// P [64 rows, 64 tokens], 16-bit, from the m64n64 accumulator layout (16 pairs per thread) into the K-major tile
// with the 128-byte swizzle that WG1's WGMMA reads: element (r, c) at r * 64 + ((c / 8) ^ (r % 8)) * 8 + c % 8.
// stmatrix x4 number i stores columns 16 i .. 16 i + 15 of the warp's 16 rows as four 8 x 8 matrices (rows + 0 / + 8,
// columns + 0 / + 8); lane l names row l % 8 of matrix l / 8.
__device__ __forceinline__ void mla_store_p64(void* p, const void* frag) {
  const int t = threadIdx.x & 127;
  const unsigned* f = reinterpret_cast<const unsigned*>(frag);
  unsigned short* base = reinterpret_cast<unsigned short*>(p);
  const int row = (t >> 5) * 16 + ((t >> 3) & 1) * 8 + (t & 7);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int chunk = (2 * i + ((t >> 4) & 1)) ^ (t & 7);
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(base + row * 64 + chunk * 8));
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(f[i * 4]), "r"(f[i * 4 + 1]), "r"(f[i * 4 + 2]), "r"(f[i * 4 + 3]) : "memory");
  }
}
// cluster_kv: a 64-token x 64-dim box of the cache multicast to both CTAs of a pair (mask), its bytes completing the
// barrier at the same offset in each. kv_cache_desc is the tensor map TileLang passes for a tma_copy of the cache in
// the kernel (the rope tile's, or with cluster_rope a never-taken one), so the macro expands only inside that kernel
// (CUtensorMap is declared after the prelude).
#define MLA_TMA_MC(bar, smem, col, slot, page, mask) mla_tma_mc(kv_cache_desc, bar, smem, col, slot, page, mask)
template <typename DescT, typename BarrierT>
__device__ __forceinline__ void mla_tma_mc(const DescT& desc, BarrierT& bar, void* smem, int col, int slot, int page,
                                           unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;"
      :: "r"((unsigned)__cvta_generic_to_shared(smem)), "l"(&desc), "r"((unsigned)__cvta_generic_to_shared(&bar)),
         "r"(col), "r"(slot), "r"(page), "h"(mask) : "memory");
}
// ws WG0 (KernelConfig.tree_max): the running row max of this thread's two rows of the m64n64 accumulator S
// (row i's 16 values at (c & 7) * 4 + i * 2 + (c >> 3)), folded by a 4-level tree instead of a 16-deep chain, then over
// the quad (lanes 4k .. 4k + 3 hold the same rows). fmax is exact: the same bits as a chain. scale_in_exp passes the
// softmax scale (log2 units) and raw scores: scale > 0, so max(scale * s) = scale * max(s) exactly (rounding is
// monotonic) and -inf stays -inf; otherwise scale is 1.
__device__ __forceinline__ void mla_row_max2(const float* s, float* m, float scale) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = fmaxf(s[j * 4 + i * 2], s[j * 4 + i * 2 + 1]);
#pragma unroll
    for (int w = 4; w >= 1; w >>= 1) {
#pragma unroll
      for (int j = 0; j < w; ++j) v[j] = fmaxf(v[j], v[j + w]);
    }
    float x = v[0];
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    m[i] = fmaxf(m[i], x * scale);
  }
}
// ws consumers: whether this thread's rows of O need rescaling. alpha holds the thread's n row factors (2 in the
// m64 accumulator layout); each is exactly 1 when its row's running max did not change, as in most blocks once
// the max has settled, and the 128-register multiply is then skipped (exact either way).
__device__ __forceinline__ int mla_rescale_needed(const float* alpha, int n) {
  int need = 0;
#pragma unroll
  for (int i = 0; i < n; ++i) need |= alpha[i] != 1.0f;
  return need;
}
// 8 bf16 values in shared memory -> fp16 x 2^-Q_F16_SHIFT, in place (Q of a kernel that computes in fp16;
// the factor keeps bf16's range: it overflows fp16 only above 2^24, and is undone exactly in the softmax scale).
__device__ __forceinline__ void mla_bf16x8_to_f16(void* p) {
  uint4 v = *reinterpret_cast<uint4*>(p);
  unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float lo = __uint_as_float(w[k] << 16) * MLA_Q_F16_SCALE, hi = __uint_as_float(w[k] & 0xFFFF0000u) * MLA_Q_F16_SCALE;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[k]) : "f"(hi), "f"(lo));
  }
  *reinterpret_cast<uint4*>(p) = v;
}
// 16 e4m3 values at src (16-byte aligned) -> 8 converted values at lo and 8 at hi (16 bytes each).
template <bool kBF16>
__device__ __forceinline__ void mla_e4m3x16_store(const void* src, void* lo, void* hi) {
  uint4 in = *reinterpret_cast<const uint4*>(src);
  uint4 a, b;
  if (kBF16) {
    a.x = mla_e4m3x2<kBF16>(in.x, 0x1404u); a.y = mla_e4m3x2<kBF16>(in.x, 0x3424u);
    a.z = mla_e4m3x2<kBF16>(in.y, 0x1404u); a.w = mla_e4m3x2<kBF16>(in.y, 0x3424u);
    b.x = mla_e4m3x2<kBF16>(in.z, 0x1404u); b.y = mla_e4m3x2<kBF16>(in.z, 0x3424u);
    b.z = mla_e4m3x2<kBF16>(in.w, 0x1404u); b.w = mla_e4m3x2<kBF16>(in.w, 0x3424u);
  } else {
    mla_e4m3x4_f16(in.x, a.x, a.y); mla_e4m3x4_f16(in.y, a.z, a.w);
    mla_e4m3x4_f16(in.z, b.x, b.y); mla_e4m3x4_f16(in.w, b.z, b.w);
  }
  *reinterpret_cast<uint4*>(lo) = a;
  *reinterpret_cast<uint4*>(hi) = b;
}
// In-kernel merge of a request split into two parts (KernelConfig.merge_pairs), both consumer warpgroups. A program
// done with its segment of the request takes a ticket (the counter's low 16 bits). The first stores its partial and
// adds 1 << 16; the second waits for that, merges the two and resets the counter for the next launch. It only waits
// for a program that already holds a ticket: resident, with nothing left to wait for before its stores, so the
// wait ends. The merge is symmetric in the two parts (same rounding whichever finishes second): deterministic.
// counts + index: the request's counter; slots + slot: shared memory that hands thread 0's ticket to the others,
// published by the slot's mbarrier in `ready` (one arrival, used once per program: phase 0 is the one to wait for).
// An mbarrier rather than the named barrier below: compute-sanitizer's racecheck reported the named-barrier hand-off
// as a hazard in this kernel, though not in a stand-alone model of it (scripts/racecheck_ticket.cu). The named
// barrier is the non-aligned `barrier.sync`: the two warpgroups reach it from different instructions, which
// `bar.sync` (= barrier.sync.aligned) leaves undefined in PTX.
__device__ __forceinline__ int mla_merge_ticket(int* counts, int index, int* slots, int slot, void* ready) {
  const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(static_cast<unsigned long long*>(ready) + slot));
  if (threadIdx.x == 0) {
    slots[slot] = atomicAdd(counts + index, 1);
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
  }
  asm volatile("{\n.reg .pred done;\nwait:\n"
               "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], 0;\n"
               "@!done bra wait;\n}" :: "r"(bar) : "memory");
  return slots[slot];
}
__device__ __forceinline__ void mla_merge_done(int* counts, int index) {
  int* count = counts + index;
  __threadfence();  // this thread's partial stores, ordered before the count that publishes them
  asm volatile("barrier.sync MLA_MERGE_BARRIER, 256;" ::: "memory");
  if (threadIdx.x == 0)
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(count), "r"(1 << MLA_MERGE_DONE_SHIFT) : "memory");
}
__device__ __forceinline__ void mla_merge_wait(int* counts, int index) {
  int* count = counts + index;
  if (threadIdx.x == 0) {
    const int target = (1 << MLA_MERGE_DONE_SHIFT) | 2;  // both tickets taken, the first partial stored
    int seen;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    while (seen != target) {
      __nanosleep(32);
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
    }
    *reinterpret_cast<volatile int*>(count) = 0;  // nothing else touches it in this launch
  }
  asm volatile("barrier.sync MLA_MERGE_BARRIER, 256;" ::: "memory");
  __threadfence();  // the other part's partial is read after this
}
// The merging program reads the other part's partial with these helpers, in the consumers' accumulator layouts.
// Loads are volatile (they stay in program order, MLA_MERGE_LOADS in flight, not all hoisted ahead of the adds) and
// from L2 (.cg: another SM wrote them); the thread index is read by volatile asm too, so that no address is hoisted
// out of the block loop into a register held across it. Products and sums round separately (no FMA contraction),
// so swapping the parts gives the same bits.
__device__ __forceinline__ float2 mla_ldcg2(const float* p) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ float mla_ldcg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int mla_wg_thread() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t & 127;
}
// Row of a thread's row value h: ws (m64 accumulator, h < 2) and tws (the 16 columns of m64n16, h < 4).
__device__ __forceinline__ int mla_row_ws(int t, int h) { return (t >> 5) * 16 + ((t & 31) >> 2) + h * 8; }
__device__ __forceinline__ int mla_row_tws(int t, int h) { return (h >> 1) * 8 + 2 * (t & 3) + (h & 1); }
// Per row of the thread: w_own holds this part's log2 LSE and becomes its weight, w_other the other part's weight
// (its LSE at lse + row; rows from rows_left on are padding), m the larger LSE (0 if both are -inf), l the sum.
template <bool kTws>
__device__ __forceinline__ void mla_merge2_weights(float* w_own, float* w_other, float* m, float* l, const float* lse,
                                                   int rows_left) {
  const int t = mla_wg_thread();
#pragma unroll
  for (int h = 0; h < (kTws ? 4 : 2); ++h) {
    const int r = kTws ? mla_row_tws(t, h) : mla_row_ws(t, h);
    const float other = r < rows_left ? mla_ldcg(lse + r) : -INFINITY;
    float top = fmaxf(w_own[h], other);
    top = top == -INFINITY ? 0.f : top;
    w_own[h] = exp2f(w_own[h] - top);
    w_other[h] = exp2f(other - top);
    m[h] = top;
    l[h] = __fadd_rn(w_own[h], w_other[h]);
  }
}
__device__ __forceinline__ float mla_merge2(float w_own, float own, float w_other, float other) {
  return __fadd_rn(__fmul_rn(w_own, own), __fmul_rn(w_other, other));
}
// ws: acc (the [64 rows, 256] accumulator, float pair q: row mla_row_ws(t, q % 2), columns (q / 2) * 8 + 2 (t % 4) +
// 0, 1) = w_own acc + w_other partial; src: the partial at the tile's first row and the warpgroup's first column.
__device__ __forceinline__ void mla_merge2_add_rows(float* acc, const float* w_own, const float* w_other,
                                                    const float* src, int rows_left) {
  const int t = mla_wg_thread();
  const float* p = src + mla_row_ws(t, 0) * 512 + 2 * (t & 3);
  const bool ok[2] = {mla_row_ws(t, 0) < rows_left, mla_row_ws(t, 1) < rows_left};
#pragma unroll
  for (int c = 0; c < 64; c += MLA_MERGE_LOADS) {
    float2 v[MLA_MERGE_LOADS];
#pragma unroll
    for (int q = 0; q < MLA_MERGE_LOADS; ++q)
      v[q] = ok[q & 1] ? mla_ldcg2(p + (q & 1) * 8 * 512 + ((c + q) >> 1) * 8) : make_float2(0.f, 0.f);
#pragma unroll
    for (int q = 0; q < MLA_MERGE_LOADS; ++q) {
      acc[2 * (c + q)] = mla_merge2(w_own[q & 1], acc[2 * (c + q)], w_other[q & 1], v[q].x);
      acc[2 * (c + q) + 1] = mla_merge2(w_own[q & 1], acc[2 * (c + q) + 1], w_other[q & 1], v[q].y);
    }
  }
}
// tws: the same for kTiles m64n16 tiles of O^T [64 dims, 16 rows] (element e of tile k: dim k * 64 + (t / 32) * 16 +
// ((e % 4) / 2) * 8 + (t % 32) / 4, row mla_row_tws(t, (e / 4) * 2 + e % 2)); src: the partial at its first row and
// the tiles' first dim.
template <int kTiles>
__device__ __forceinline__ void mla_merge2_add_cols(float* acc, const float* w_own, const float* w_other,
                                                    const float* src, int rows_left) {
  const int t = mla_wg_thread();
  const float* p = src + (t >> 5) * 16 + ((t & 31) >> 2);
#pragma unroll
  for (int k0 = 0; k0 < kTiles; k0 += 2) {
    float v[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int k = k0 + e / 8, r = mla_row_tws(t, ((e & 7) >> 2) * 2 + (e & 1));
      v[e] = k < kTiles && r < rows_left ? mla_ldcg(p + r * 512 + k * 64 + ((e & 3) >> 1) * 8) : 0.f;
    }
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      const int h = ((e & 7) >> 2) * 2 + (e & 1);
      if (k0 + e / 8 < kTiles) acc[k0 * 8 + e] = mla_merge2(w_own[h], acc[k0 * 8 + e], w_other[h], v[e]);
    }
  }
}
'''.replace("MLA_Q_F16_SCALE", f"{2.0 ** -Q_F16_SHIFT!r}f").replace(
    "MLA_MERGE_BARRIER", str(MERGE_NAMED_BARRIER)).replace("MLA_MERGE_DONE_SHIFT", str(MERGE_DONE_SHIFT)).replace(
    "MLA_MERGE_LOADS", str(MERGE_LOADS))

# KernelConfig.trace_part: clock64 per (role, block g < 64, step) of one program (row block 0), written to the last
# slot of out_partial, which no plan uses (slots go up to num_parts + batch - 2): int64 [role][g][step], then per role
# its first step's clock and %globaltimer (ns) and its last clock and ns. Roles: 0 WG0, 1 WG1, 2 the producer; steps as
# the trace() calls name them. No printf: a function call in the kernel makes ptxas serialise every WGMMA.
TRACE_ROLES, TRACE_BLOCKS, TRACE_STEPS = 3, 64, 8
TRACE_HEAD = TRACE_ROLES * TRACE_BLOCKS * TRACE_STEPS  # where the per-role (clock, ns, clock, ns) words start
TRACE_WORDS = TRACE_HEAD + TRACE_ROLES * 4
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
                rs_pv: bool = False, merge: bool = False) -> dict:
    """Shared-memory bytes of the warp-specialised kernel (the docstring's table).

    ``dynamic`` is what TileLang allocates (``dyn_shared_memory_buf``); the mbarriers are static
    ``__shared__`` arrays, which nvcc pads to 1024 B so that the 1024-aligned dynamic buffer follows.
    ``transposed`` (tws): Q and P have TWS_COLS rows, plus 128 floats each for the column max exchange
    (``mla_colmax4``, two halves by block parity) and TileLang's scratch for the column sums. ``rs_pv``: two
    alpha slots instead of one. ``merge`` (merge_pairs): WG0 hands WG1 its row maxima beside l, and the merge
    ticket's two slots (16 B with TileLang's alignment).
    """
    q_rows = TWS_COLS if transposed else block_rows
    parts = {
        "q": q_rows * HEAD_DIM * elem_bytes,
        "kv": 2 * block_n * HEAD_DIM * elem_bytes,
        "p": q_rows * block_n * elem_bytes,
        "alpha_l": (3 if rs_pv and not transposed else 2) * q_rows * 4,
    }
    if merge:
        parts["alpha_l"] += q_rows * 4
        parts["merge_ticket"] = 16
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


# seesaw: each KV buffer is three tiles (rope, left 256 dims, right 256 dims), each with its own k_ready / k_free
# barrier, so a tile is refilled as soon as its last reader is done with it, not when the whole block is.
PART_T, PART_L, PART_R = 0, 1, 2
N_PARTS = 3


def part_barrier(g, part):
    """Index of the k_ready / k_free barrier of tile ``part`` of the buffer holding block g (seesaw)."""
    return kv_buffer(g) * N_PARTS + part


def pair_ready_parity(pc):
    """seesaw: p_ready / pb_ready: wait for completion pc (pair pc's P_a and m0 / P_b and M written)."""
    return pc & 1


def pair_free_parity(pc):
    """seesaw: WG0, before writing P_a of pair pc, waits for completion pc - 1 of p_free."""
    return (pc & 1) ^ 1


def segment_first_block(part_lo, req_lo, blk_lo):
    """g of a request segment's first block: its flat block index minus the part's first one."""
    return req_lo + blk_lo - part_lo


def make_store_cols(num_heads: int, q_len: int, ndims: int, col0: int = 0, with_lse: bool = True) -> SegmentStore:
    """tws segment epilogue: ``make_store_rows`` for a transposed accumulator ``acc [ndims, TWS_COLS]`` (dims
    ``col0 .. col0 + ndims`` of 512 x rows; one row block). Columns past ``num_heads * q_len`` are padding."""
    rows = num_heads * q_len
    accum = "float32"

    @T.macro
    def normalize(acc, l_sum, kv_scale, factor):
        for i in T.Parallel(TWS_COLS):
            factor[i] = T.if_then_else(l_sum[i] > 0, kv_scale / l_sum[i], 0)
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
                            l_sum[i] > 0, (T.log2(l_sum[i]) + m_cur[i]) * LN2, -T.infinity(accum))
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
            acc[d, i] = T.if_then_else(l_sum[i] > 0, acc[d, i] * kv_scale / l_sum[i], 0)
        write(acc, l_sum, m_cur, direct, slot, tok0, 0, out, lse, out_partial, lse_partial)

    return SegmentStore(normalize, write, store)


def build_decode_kernel_ws(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                           cfg: KernelConfig = SM90_WS):
    """Returns the warp-specialised split-KV prim_func (Hopper only, sm_90a).

    Arguments of the returned function: exactly those of ``build_decode_kernel`` (same order):
        q_nope ``[num_tokens, H, 512]``, q_pe ``[num_tokens, H, 64]`` (``dtype``);
        kv_cache ``[num_pages, page_size, 576]`` (``kv_dtype``); k_scale fp32 ``[1]``;
        page_table int32 ``[num_entries]``; page_table_start, kv_lens int32 ``[batch]``;
        qo_indptr int32 ``[batch + 1]``; cu_blocks int32 ``[batch + 1]`` (64-token blocks);
        part_begin_req, part_end_req int32 ``[num_parts]``; blocks_per_part int32 ``[1]``;
        sm_scale fp32 ``[1]``;
        out ``[num_tokens, H, 512]`` (``dtype``); lse fp32 ``[num_tokens, H]`` (natural log);
        out_partial fp32 ``[num_slots, H * q_len, 512]``; lse_partial fp32 ``[num_slots, H * q_len]`` (log2).
    """
    block_rows, block_n = cfg.block_rows, cfg.block_n
    if (block_rows, block_n, cfg.threads) != (64, 64, 384):
        raise ValueError(f"the warp-specialised kernel is written for 64 rows x 64 tokens x 384 threads, got {cfg}")
    is_fp8 = kv_dtype != dtype
    # seesaw: 16-bit caches (an fp8 cache compiles the ws kernel, whose producer converts in registers)
    seesaw = cfg.kernel == "seesaw" and not is_fp8
    rows = num_heads * q_len
    # tws: transposed consumers where the rows fit one m64n16 tile (one row block); the ws kernel otherwise
    transposed = cfg.kernel == "tws" and rows <= TWS_COLS
    q_rows = TWS_COLS if transposed else block_rows  # rows of the Q and P tiles
    s_regs = block_n * q_rows // 128  # fp32 registers of S per consumer thread (128 per warpgroup)
    n_row_blocks = num_row_blocks(num_heads, q_len, block_rows)
    pad_rows = n_row_blocks * q_rows != rows  # the last row block has rows that are never stored
    accum = "float32"
    # each consumer warpgroup stores its 256 output columns; WG0 also owns the LSE
    store_left = make_store_rows(num_heads, q_len, block_rows, HALF)
    store_right = make_store_rows(num_heads, q_len, block_rows, HALF, col0=HALF, with_lse=False)
    store_left_t = make_store_cols(num_heads, q_len, HALF)
    store_right_t = [make_store_cols(num_heads, q_len, TWS_TILE, col0=HALF + k * TWS_TILE, with_lse=False)
                     for k in range(HALF // TWS_TILE)]
    # producer thread t copies 16-byte chunks: row (r * 16 + t // 8) of a 64-row tile, chunk t % 8 (+ 8 u)
    vec = 8  # dtype elements per 16-byte cp.async
    # fp8 cache, ws: the producer keeps one row's loads in flight while it converts the other (next block's row 0
    # during this block's row 1); tws: a whole block ahead, in two sets of two rows (set g & 1 holds block g's rows)
    ahead_fp8 = is_fp8 and transposed
    # tws, fp8 cache, several producer warpgroups: block g is converted by producer g % n_producers, from one set
    threads = kernel_threads(is_fp8, transposed)
    n_producers = threads // 128 - 2
    rr_fp8 = n_producers > 1
    fp8_rows = 2 if rr_fp8 or not ahead_fp8 else 4  # KV rows of raw bytes a producer thread holds
    # ws with an fp8 cache computes in fp16 (shared tiles, P): e4m3 -> fp16 is one instruction per pair
    # (bf16 takes five), exact, and fp16 holds P and the e4m3 values with more precision than bf16. A bf16
    # q is converted in shared memory, times 2^-Q_F16_SHIFT (undone in the softmax scale).
    cdtype = "float16" if is_fp8 else dtype
    q_to_f16 = cdtype != dtype
    convert = "mla_e4m3x16_store<true>" if cdtype == "bfloat16" else "mla_e4m3x16_store<false>"
    regs_wg0, regs_wg1, regs_producer = register_budget(is_fp8, seesaw, transposed)
    # 16-bit cache, blocks never straddle pages: a whole block is nine TMA boxes of 64 tokens x 64 dims (one
    # thread issues them; the tensor map views the cache as [num_pages, page_size, 576]). A request's last,
    # partial block keeps the cp.async gather, which re-reads its last row instead of stale slots.
    tma_kv = cfg.tma_kv and not is_fp8 and page_size % block_n == 0
    # ws WG0 multiplies its half of P V from P in registers (as FlashAttention-3's first consumer does for
    # head_dim_v 512): no WGMMA of WG0 reads P's shared tile (WG1's copy), so WG0 stores P and alpha without a
    # barrier of its own and issues its GEMM before handing P to WG1; alpha goes to a slot per block parity, so
    # it is stored before WG0 waits for WG1 to be done with the previous P.
    rs_pv = cfg.rs_pv and not transposed and not seesaw
    # rs_pv: WG0 hands P to WG1 and issues its P V right after P is made; its row sums (per thread, the quad's added
    # once per segment) follow while the GEMMs run
    pv_first = rs_pv and cfg.pv_first
    # ws, 16-bit cache: each tile of a KV buffer (left, right, rope) lands on its own k_ready, so WG0's S starts on
    # the left tile while the rest is in flight and WG1 waits for its V half only; the buffer is freed as one
    tile_ready = cfg.tile_ready and not seesaw and not transposed and not is_fp8
    # cluster_kv: the CTAs of row blocks 2i and 2i + 1 of a part (one cluster) walk the same blocks; of a whole block,
    # rank 0 issues the left tile and rank 1 the right tile, each multicast to both (the rope tile: below); a buffer
    # is refilled once the consumers of both CTAs have released it (k_free counts both CTAs' arrivals)
    cluster = cfg.cluster_kv and tma_kv and tile_ready and n_row_blocks % 2 == 0
    # cluster_kv: the rope box multicast too, by rank g % 2 (else each CTA loads its own)
    cluster_rope = cluster and cfg.cluster_rope

    def box_issuer(part, g):
        """The rank of a cluster_kv pair that issues tile ``part`` of block g for both CTAs."""
        return g % 2 if part == PART_T else (0 if part == PART_L else 1)

    # ws WG0: S's row max by a tree (a prelude helper on the m64n64 accumulator) instead of TileLang's chain
    tree_max = cfg.tree_max and not seesaw and not transposed
    # rs_pv WG0, FlashAttention-3's order: P's stores for WG1, WG0's own P V issued, then the fence (it waits for the
    # stores) and p_ready, so WG0's GEMM no longer waits for the fence
    pv_early = pv_first and cfg.pv_early
    # rs_pv WG0: O's rescale right after alpha and unconditional, so ptxas can interleave its multiplies with P's
    # exp2s (which the MUFU pipe bounds) instead of running them after P's hand-over
    rescale_early = rs_pv and cfg.rescale_early
    # rs_pv WG0 with tree_max: the row max of the raw scores times the (positive) scale, P = exp2(S * scale - m) as
    # one FFMA per element (no multiply of S before the max)
    scale_in_exp = rs_pv and tree_max and cfg.scale_in_exp
    # rs_pv WG0: the wait for WG1 to be done with P (g - 1) right after S (g), so that no wait (a branch) splits the
    # code from the row max to P's stores, which ptxas then schedules as one block
    pfree_early = rs_pv and cfg.pfree_early
    # a request split into two parts is merged by the second of its programs to finish (merge_begin), not by the
    # combine kernel
    in_merge = merged_parts(cfg) == 2

    tracing = cfg.trace_part >= 0

    @T.macro
    def trace(role, g, step):
        """KernelConfig.trace_part: this role's clock at ``step`` of block g (nothing otherwise)."""
        if tracing:
            T.evaluate(T.call_extern("handle", "mla_trace", role, g, step))

    @T.macro
    def trace_end(role):
        if tracing:
            T.evaluate(T.call_extern("handle", "mla_trace_end", role))

    def last_copy_barrier(g):
        """The k_ready barrier of block g's last copy (seesaw: its right tile)."""
        if seesaw:
            return part_barrier(g, PART_R)
        return part_barrier(g, PART_T) if tile_ready else kv_buffer(g)

    num_tokens = T.dynamic("num_tokens")
    batch = T.dynamic("batch")
    num_pages = T.dynamic("num_pages")
    num_entries = T.dynamic("num_entries")
    num_parts = T.dynamic("num_parts")
    num_slots = T.dynamic("num_slots")
    num_counts = T.dynamic("num_counts")
    # q is read through runtime (token, head) strides, as in mla_decode (the op guarantees 16-byte
    # aligned rows for cp.async).
    q_nope_stride = (T.dynamic("q_nope_stride_t"), T.dynamic("q_nope_stride_h"), 1)
    q_pe_stride = (T.dynamic("q_pe_stride_t"), T.dynamic("q_pe_stride_h"), 1)

    @T.macro
    def load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t):
        """cp.async of the segment's valid Q rows (rows past ``rows`` keep the zeros written at start)."""
        for r in T.serial(q_rows // 16):
            i = r * 16 + t // 8
            if row0 + i < rows:
                for u in T.serial(HALF // (8 * vec)):
                    c = u * 8 * vec + (t % 8) * vec
                    T.ptx_cp_async(
                        T.access_ptr(q_l[i, c], "w", vec),
                        T.access_ptr(q_nope[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, c], "r", vec),
                        vec)
                    T.ptx_cp_async(
                        T.access_ptr(q_r[i, c], "w", vec),
                        T.access_ptr(q_nope[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, HALF + c], "r", vec),
                        vec)
                T.ptx_cp_async(
                    T.access_ptr(q_t[i, (t % 8) * vec], "w", vec),
                    T.access_ptr(q_pe[tok0 + (row0 + i) // num_heads, (row0 + i) % num_heads, (t % 8) * vec], "r", vec),
                    vec)

    @T.macro
    def store_converted(raw, chunk, dst, j, c):
        """16 e4m3 values of ``raw[chunk]`` -> ``dst[j, c .. c + 15]`` in ``cdtype``, as two 16-byte stores
        (the shared tiles are swizzled in 16-byte units)."""
        # tws: plain addresses, so TileLang's thread-sync pass sees no producer write to shared memory. Each
        # thread writes only its own bytes and no producer thread reads them (the consumers wait on k_ready), yet
        # for the access_ptr form TileLang 0.1.9 puts 0..8 named barriers among the producer warps per block, a
        # different number from one compile of the same kernel to the next.
        if ahead_fp8:
            lo, hi = T.address_of(dst[j, c]), T.address_of(dst[j, c + 8])
        else:
            lo, hi = T.access_ptr(dst[j, c], "w", 8), T.access_ptr(dst[j, c + 8], "w", 8)
        T.evaluate(T.call_extern("handle", convert, T.access_ptr(raw[chunk, 0], "r", 16), lo, hi))

    def fp8_row(pos0, r, t, kv_len):
        """Position of the fp8 producer thread t's row r (t // 4 + 32 r) of the block at pos0, tail clamped."""
        return T.min(pos0 + r * 32 + t // 4, kv_len - 1)

    @T.macro
    def fp8_pages(page_table, pt0, pos0, kv_len, pages, t):
        """pages[r]: the page holding row t // 4 + 32 r of the block at pos0 (tail rows clamped)."""
        for r in T.unroll(2):
            pages[r] = page_table[pt0 + fp8_row(pos0, r, t, kv_len) // page_size]

    @T.macro
    def fp8_issue_row(kv_cache, page, pos0, kv_len, raw, slot, r, t):
        """Loads (no wait) this thread's 9 chunks of row t // 4 + 32 r of the block at pos0 into raw slot
        ``slot``: chunks t % 4 + 4 k, k = 0..8 (512 latent dims, then 64 rope dims); 4 threads per row."""
        p = fp8_row(pos0, r, t, kv_len)
        for k in T.unroll(9):
            T.evaluate(T.call_extern("handle", "mla_ldg16", T.access_ptr(raw[slot * 9 + k, 0], "w", 16),
                                     T.access_ptr(kv_cache[page, p % page_size, k * 64 + (t % 4) * 16], "r", 16)))

    @T.macro
    def fp8_convert_row(raw, slot, r, kv_l, kv_r, k_t, t, first=0):
        """raw slot ``slot`` (row t // 4 + 32 r) -> ``cdtype`` in the shared tiles (exact); ``first``: chunks
        before it are already stored (0 or 1)."""
        j = r * 32 + t // 4
        for k in T.unroll(4 - first):
            store_converted(raw, slot * 9 + first + k, kv_l, j, (first + k) * 64 + (t % 4) * 16)
        for k in T.unroll(4):
            store_converted(raw, slot * 9 + 4 + k, kv_r, j, k * 64 + (t % 4) * 16)
        store_converted(raw, slot * 9 + 8, k_t, j, (t % 4) * 16)

    @T.macro
    def fp8_block(kv_cache, pages, pos0, kv_len, has_next, raw, kv_l, kv_r, k_t, t):
        """Second half of the ws producer's fp8 pipeline for one block (its buffer is free): row 0 is in
        flight since the previous block, row 1 since just before the k_free wait. Converting row 0 frees
        its registers for the next block's row 0, whose loads then overlap the conversion of row 1."""
        fp8_convert_row(raw, 0, 0, kv_l, kv_r, k_t, t)
        if has_next:
            fp8_issue_row(kv_cache, pages[0], pos0 + block_n, kv_len, raw, 0, 0, t)
        fp8_convert_row(raw, 1, 1, kv_l, kv_r, k_t, t)

    @T.macro
    def fp8_issue_rows(kv_cache, pages, pos0, kv_len, raw, slot0, t):
        """Loads (no wait) both of this thread's rows of the block at pos0 into raw slots slot0, slot0 + 1
        (``slot0`` a constant, so raw stays in registers); ``pages`` holds their pages."""
        for r in T.unroll(2):
            fp8_issue_row(kv_cache, pages[r], pos0, kv_len, raw, slot0 + r, r, t)

    @T.macro
    def fp8_issue_block(kv_cache, pages, pos0, kv_len, raw, g, t):
        """tws producer: fp8_issue_rows for block g into raw set ``kv_buffer(g)`` (slots 2 set, 2 set + 1)."""
        if kv_buffer(g) == 0:
            fp8_issue_rows(kv_cache, pages, pos0, kv_len, raw, 0, t)
        else:
            fp8_issue_rows(kv_cache, pages, pos0, kv_len, raw, 2, t)

    @T.macro
    def fp8_produce_block(kv_cache, page_table, pt0, pos0, kv_len, n_left, pages, raw, row_set, kv_l, kv_r, k_t, t):
        """tws producer, one block (its buffer is free): raw set ``row_set`` (this thread's 2 rows) -> the
        block's shared tiles, and the next block's loads into the other set. ptxas counts all of a thread's
        loads on one scoreboard, so a conversion waits for every load in flight: the next block's rows are
        issued right after the first conversion (which waits for this block's, issued a block ago), not
        before it, where that wait would include them and expose their whole latency every block. Then the
        page entries of the block after. Conversions and loads are volatile asm, kept in this order by ptxas.
        (No L2 prefetch here: L2 is the busy unit, and prefetches only added requests to it.)"""
        slot = 2 * row_set
        store_converted(raw, slot * 9, kv_l, t // 4, (t % 4) * 16)  # row 0's first chunk: waits for this block's loads
        if n_left > 1:
            fp8_issue_row(kv_cache, pages[0], pos0 + block_n, kv_len, raw, 2 - slot, 0, t)
            fp8_issue_row(kv_cache, pages[1], pos0 + block_n, kv_len, raw, 3 - slot, 1, t)
            if n_left > 2:
                fp8_pages(page_table, pt0, pos0 + 2 * block_n, kv_len, pages, t)
        fp8_convert_row(raw, slot, 0, kv_l, kv_r, k_t, t, 1)
        fp8_convert_row(raw, slot + 1, 1, kv_l, kv_r, k_t, t)

    @T.macro
    def kv_pages(page_table, pt0, pos0, kv_len, pages, t):
        """pages[r]: the page of row r * 16 + t // 8 of the block at pos0, tail rows clamped (16-bit cache)."""
        for r in T.unroll(block_n // 16):
            pages[r] = page_table[pt0 + T.min(pos0 + r * 16 + t // 8, kv_len - 1) // page_size]

    @T.macro
    def load_kv(kv_cache, pages, pos0, kv_len, kv_l, kv_r, k_t, t):
        """Gathers KV rows pos0 .. pos0 + 63 of one request into one buffer (3 tiles: 256 | 256 | 64 dims), from the
        pages ``kv_pages`` read.

        Rows past kv_len re-read row kv_len - 1 (their probabilities are 0): no page outside the
        request is touched and no stale (possibly NaN) cache slot can reach P @ V.
        """
        for r in T.serial(block_n // 16):
            j = r * 16 + t // 8
            p = T.min(pos0 + j, kv_len - 1)
            page = pages[r]
            slot = p % page_size
            for u in T.serial(HALF // (8 * vec)):
                c = u * 8 * vec + (t % 8) * vec
                T.ptx_cp_async(T.access_ptr(kv_l[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, slot, c], "r", vec), vec)
                T.ptx_cp_async(T.access_ptr(kv_r[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, slot, HALF + c], "r", vec), vec)
            T.ptx_cp_async(T.access_ptr(k_t[j, (t % 8) * vec], "w", vec),
                           T.access_ptr(kv_cache[page, slot, KV_LORA_RANK + (t % 8) * vec], "r", vec), vec)

    @T.macro
    def load_kv_tma(kv_cache, page, pos0, kv_l, kv_r, k_t, k_ready, buf):
        """load_kv of a whole block (pos0 + 64 <= kv_len, all in ``page``) by TMA, completing on ``k_ready[buf]``
        (one thread's expect_tx)."""
        slot0 = pos0 % page_size
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, 0:HALF], kv_l, barrier=k_ready[buf])
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, HALF:KV_LORA_RANK], kv_r, barrier=k_ready[buf])
        T.tma_copy(kv_cache[page, slot0:slot0 + block_n, KV_LORA_RANK:HEAD_DIM], k_t, barrier=k_ready[buf])

    @T.macro
    def load_part(kv_cache, pages, pos0, kv_len, dst, col0, t):
        """load_kv for one tile of a buffer: cache dims col0 .. col0 + width of rows pos0 .. pos0 + 63 into
        ``dst`` [64, width] (width 256 or 64; 8 lanes per row, 16 rows per pass), from the pages ``kv_pages`` read."""
        for r in T.serial(block_n // 16):
            j = r * 16 + t // 8
            p = T.min(pos0 + j, kv_len - 1)
            page = pages[r]
            for u in T.serial(dst.shape[1] // (8 * vec)):
                c = u * 8 * vec + (t % 8) * vec
                T.ptx_cp_async(T.access_ptr(dst[j, c], "w", vec),
                               T.access_ptr(kv_cache[page, p % page_size, col0 + c], "r", vec), vec)

    @T.macro
    def fill_part(kv_cache, pages, pos0, kv_len, dst, col0, g, part, k_ready, k_free, t):
        """Tile ``part`` of block g's buffer, signalled on its own ``k_ready`` (seesaw: once its last reader has
        released it; tile_ready: the caller waited for the whole buffer); a whole block's tile by TMA (expect_tx by
        one thread), a partial block's by the cp.async gather."""
        if seesaw:
            T.barrier_wait(k_free[part_barrier(g, part)], kv_free_parity(g))
        if tma_kv and pos0 + block_n <= kv_len:
            slot0 = pos0 % page_size
            if cluster and (part != PART_T or cluster_rope):
                if t == 0:  # both CTAs expect the tile; one of them issues each box for both
                    T.mbarrier_expect_tx(k_ready[part_barrier(g, part)], block_n * dst.shape[1] * 2)
                    if T.block_rank_in_cluster() == box_issuer(part, g):
                        for c in T.unroll(dst.shape[1] // 64):
                            T.evaluate(T.call_extern("handle", "MLA_TMA_MC", k_ready[part_barrier(g, part)],
                                                     T.access_ptr(dst[0, c * 64], "w", 1), col0 + c * 64, slot0,
                                                     pages[0], 3))
            else:
                T.tma_copy(kv_cache[pages[0], slot0:slot0 + block_n, col0:col0 + dst.shape[1]],
                           dst, barrier=k_ready[part_barrier(g, part)])
            T.barrier_arrive(k_ready[part_barrier(g, part)])
        else:
            load_part(kv_cache, pages, pos0, kv_len, dst, col0, t)
            T.cp_async_barrier_noinc(k_ready[part_barrier(g, part)])

    @T.macro
    def release_kv(k_free, g, tx):
        """A consumer thread is done reading block g's buffer; cluster: its warp (once all of its lanes are, lane 0
        for them) also tells the other CTA of the pair, whose producer refills both CTAs' buffers."""
        T.barrier_arrive(k_free[kv_buffer(g)])
        if cluster:
            if tx % 32 == 0:
                T.mbarrier_arrive(k_free[kv_buffer(g)], 1 - T.block_rank_in_cluster())

    @T.macro
    def load_parts(kv_cache, pages, pos0, kv_len, kv_l, kv_r, k_t, g, k_ready, k_free, t):
        """Block g, tile by tile, each signalled on its own ``k_ready`` in the order S reads them: seesaw (rope, left,
        right) refills each tile as soon as its last reader has released it (``k_free[part_barrier(g, part)]``);
        tile_ready (left, right, rope) after the caller waited for the whole buffer."""
        if tile_ready:
            fill_part(kv_cache, pages, pos0, kv_len, kv_l, 0, g, PART_L, k_ready, k_free, t)
            fill_part(kv_cache, pages, pos0, kv_len, kv_r, HALF, g, PART_R, k_ready, k_free, t)
            fill_part(kv_cache, pages, pos0, kv_len, k_t, KV_LORA_RANK, g, PART_T, k_ready, k_free, t)
        else:
            fill_part(kv_cache, pages, pos0, kv_len, k_t, KV_LORA_RANK, g, PART_T, k_ready, k_free, t)
            fill_part(kv_cache, pages, pos0, kv_len, kv_l, 0, g, PART_L, k_ready, k_free, t)
            fill_part(kv_cache, pages, pos0, kv_len, kv_r, HALF, g, PART_R, k_ready, k_free, t)

    @T.macro
    def prefetch_block(kv_cache, page_table, pt0, pos0, kv_len, t):
        """Asks L2 for the fp8 cache rows pos0 .. pos0 + 63 of one request: thread t takes half t % 2 of
        row t // 2 (288 bytes, at most 4 lines: bytes 0, 128, 256 and 287 of the half). Per-thread line
        prefetches: the bulk form takes a warp-uniform address and would loop over the warp's rows."""
        p = pos0 + t // 2
        if p < kv_len:
            page = page_table[pt0 + p // page_size]
            for u in T.unroll(4):
                T.evaluate(T.call_extern("handle", "mla_l2_prefetch", T.access_ptr(
                    kv_cache[page, p % page_size, (t % 2) * (HEAD_DIM // 2) + T.min(u * 128, HEAD_DIM // 2 - 1)],
                    "r", 1)))

    @T.macro
    def stream_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg, pw,
                       pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, q_free, q_ready, k_free,
                       k_ready, t):
        """The producer warpgroup, one request segment (blocks blk_lo .. blk_hi - 1 of the request, g0 the first's
        g): Q, then every block, through cp.async (seesaw: tile by tile), or an fp8 cache's loads and conversions
        (ws, tws with one producer)."""
        # Q of segment seg: WG0 has finished reading Q of segment seg - 1
        # the segment's first blocks (ws: later ones are asked for FP8_PREFETCH_AHEAD ahead)
        if is_fp8:
            for a in T.serial(FP8_PREFETCH_AHEAD):
                if blk_lo + a < blk_hi:
                    prefetch_block(kv_cache, page_table, pt0, (blk_lo + a) * block_n, kv_len, t)
        if ahead_fp8:  # the segment's first block (later ones: during the block before)
            fp8_pages(page_table, pt0, blk_lo * block_n, kv_len, pages, t)
            fp8_issue_block(kv_cache, pages, blk_lo * block_n, kv_len, raw, g0, t)
            if blk_lo + 1 < blk_hi:
                fp8_pages(page_table, pt0, (blk_lo + 1) * block_n, kv_len, pages, t)
        elif is_fp8:  # row 0 of the segment's first block (later ones: during the previous block)
            fp8_pages(page_table, pt0, blk_lo * block_n, kv_len, pages, t)
            fp8_issue_row(kv_cache, pages[0], blk_lo * block_n, kv_len, raw, 0, 0, t)
        T.barrier_wait(q_free[0], seg_free_parity(seg))
        load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t)
        T.cp_async_barrier_noinc(q_ready[0])
        for blk in T.serial(blk_hi - blk_lo):
            g = g0 + blk
            pos0 = (blk_lo + blk) * block_n
            if is_fp8 and not ahead_fp8 and blk_lo + blk + FP8_PREFETCH_AHEAD < blk_hi:
                prefetch_block(kv_cache, page_table, pt0, pos0 + FP8_PREFETCH_AHEAD * block_n, kv_len, t)
            if is_fp8 and not ahead_fp8:  # loads go to registers: issue them before the buffer is free
                fp8_issue_row(kv_cache, pages[1], pos0, kv_len, raw, 1, 1, t)
                if blk + 1 < blk_hi - blk_lo:
                    fp8_pages(page_table, pt0, pos0 + block_n, kv_len, pages, t)
            trace(2, g, 0)
            # 16-bit cache: the block's pages are read before the wait for its buffer, so that the page table's
            # latency overlaps the wait instead of delaying the copies (pages_ahead, else after it; seesaw: always
            # before its three tile waits)
            if not is_fp8 and (cfg.pages_ahead or seesaw):
                kv_pages(page_table, pt0, pos0, kv_len, pages, t)
            if seesaw:  # per tile: waits for its release, signals its arrival
                if kv_buffer(g) == 0:
                    load_parts(kv_cache, pages, pos0, kv_len, kv0_l, kv0_r, k0_t, g, k_ready, k_free, t)
                else:
                    load_parts(kv_cache, pages, pos0, kv_len, kv1_l, kv1_r, k1_t, g, k_ready, k_free, t)
            else:
                # both consumers are done with the block that used this buffer before (g - 2)
                trace(2, g, 1)
                T.barrier_wait(k_free[kv_buffer(g)], kv_free_parity(g))
                trace(2, g, 2)
                if not is_fp8 and not cfg.pages_ahead:
                    kv_pages(page_table, pt0, pos0, kv_len, pages, t)
                if ahead_fp8:  # (tws: the next block's loads are issued in there)
                    if kv_buffer(g) == 0:
                        fp8_produce_block(kv_cache, page_table, pt0, pos0, kv_len, blk_hi - blk_lo - blk,
                                          pages, raw, 0, kv0_l, kv0_r, k0_t, t)
                    else:
                        fp8_produce_block(kv_cache, page_table, pt0, pos0, kv_len, blk_hi - blk_lo - blk,
                                          pages, raw, 1, kv1_l, kv1_r, k1_t, t)
                elif is_fp8:
                    if kv_buffer(g) == 0:
                        fp8_block(kv_cache, pages, pos0, kv_len, blk + 1 < blk_hi - blk_lo, raw,
                                  kv0_l, kv0_r, k0_t, t)
                    else:
                        fp8_block(kv_cache, pages, pos0, kv_len, blk + 1 < blk_hi - blk_lo, raw,
                                  kv1_l, kv1_r, k1_t, t)
                elif tile_ready:
                    if kv_buffer(g) == 0:
                        load_parts(kv_cache, pages, pos0, kv_len, kv0_l, kv0_r, k0_t, g, k_ready, k_free, t)
                    else:
                        load_parts(kv_cache, pages, pos0, kv_len, kv1_l, kv1_r, k1_t, g, k_ready, k_free, t)
                elif tma_kv and pos0 + block_n <= kv_len:
                    if kv_buffer(g) == 0:
                        load_kv_tma(kv_cache, pages[0], pos0, kv0_l, kv0_r, k0_t, k_ready, 0)
                    else:
                        load_kv_tma(kv_cache, pages[0], pos0, kv1_l, kv1_r, k1_t, k_ready, 1)
                elif kv_buffer(g) == 0:
                    load_kv(kv_cache, pages, pos0, kv_len, kv0_l, kv0_r, k0_t, t)
                else:
                    load_kv(kv_cache, pages, pos0, kv_len, kv1_l, kv1_r, k1_t, t)
                if is_fp8:
                    T.fence_proxy_async()  # generic stores, read by WGMMA (async proxy)
                    T.barrier_arrive(k_ready[kv_buffer(g)])
                elif not tile_ready:  # (tile_ready: each tile signalled its own k_ready in fill_part)
                    if tma_kv and pos0 + block_n <= kv_len:  # the TMA bytes complete the phase, not the arrivals
                        T.barrier_arrive(k_ready[kv_buffer(g)])
                    else:
                        T.cp_async_barrier_noinc(k_ready[kv_buffer(g)])
                trace(2, g, 3)

    @T.macro
    def rr_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi, g0, seg, pw,
                   pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, q_free, q_ready, k_free,
                   k_ready, t):
        """tws fp8, producer warpgroup ``pw`` of ``n_producers``, one request segment: its blocks are blk = first,
        first + n, ... (g = g0 + blk, g % n == pw). This thread's two rows of a block are converted from the raw
        registers, then the loads of the producer's next block are issued into them: no conversion of this thread
        waits for those loads before that block's turn, n blocks later. Producer 0 also loads the segment's Q."""
        n_blk = blk_hi - blk_lo
        first = (pw + n_producers - g0 % n_producers) % n_producers
        if first < n_blk:
            fp8_pages(page_table, pt0, (blk_lo + first) * block_n, kv_len, pages, t)
            fp8_issue_rows(kv_cache, pages, (blk_lo + first) * block_n, kv_len, raw, 0, t)
            if first + n_producers < n_blk:
                fp8_pages(page_table, pt0, (blk_lo + first + n_producers) * block_n, kv_len, pages, t)
        if pw == 0:
            T.barrier_wait(q_free[0], seg_free_parity(seg))
            load_q(q_nope, q_pe, q_l, q_r, q_t, tok0, row0, t)
            T.cp_async_barrier_noinc(q_ready[0])
        for i in T.serial((n_blk - first + n_producers - 1) // n_producers):
            blk = first + i * n_producers
            g = g0 + blk
            pos0 = (blk_lo + blk) * block_n
            T.barrier_wait(k_free[kv_buffer(g)], kv_free_parity(g))
            if kv_buffer(g) == 0:
                fp8_convert_row(raw, 0, 0, kv0_l, kv0_r, k0_t, t)
                fp8_convert_row(raw, 1, 1, kv0_l, kv0_r, k0_t, t)
            else:
                fp8_convert_row(raw, 0, 0, kv1_l, kv1_r, k1_t, t)
                fp8_convert_row(raw, 1, 1, kv1_l, kv1_r, k1_t, t)
            T.fence_proxy_async()  # generic stores, read by WGMMA (async proxy)
            T.barrier_arrive(k_ready[kv_buffer(g)])
            if blk + n_producers < n_blk:
                fp8_issue_rows(kv_cache, pages, pos0 + n_producers * block_n, kv_len, raw, 0, t)
                if blk + 2 * n_producers < n_blk:
                    fp8_pages(page_table, pt0, pos0 + 2 * n_producers * block_n, kv_len, pages, t)

    produce_segment = rr_segment if rr_fp8 else stream_segment

    @T.macro
    def score_tile(q, kv, g, part, k_ready, acc_s):
        """S += Q K^T over one tile of block g's buffer, once that tile has landed (seesaw, tile_ready)."""
        T.barrier_wait(k_ready[part_barrier(g, part)], kv_ready_parity(g))
        T.wgmma_gemm(q, kv, acc_s, transpose_B=True)

    @T.macro
    def score(q_l, q_r, q_t, kv_l, kv_r, k_t, g, k_ready, acc_s):
        """S = Q K^T (rows x tokens); tws: S^T = K Q^T (tokens x rows); seesaw (rope, left, right) and tile_ready
        (left, right, rope): each tile's WGMMA issued as soon as that tile of block g has landed, in the order the
        producer fills them in."""
        T.clear(acc_s)
        if transposed:
            T.wgmma_gemm(kv_l, q_l, acc_s, transpose_B=True)
            T.wgmma_gemm(kv_r, q_r, acc_s, transpose_B=True)
            T.wgmma_gemm(k_t, q_t, acc_s, transpose_B=True)
        elif seesaw:  # each tile's WGMMA as soon as it has landed, in the producer's order
            score_tile(q_t, k_t, g, PART_T, k_ready, acc_s)
            score_tile(q_l, kv_l, g, PART_L, k_ready, acc_s)
            score_tile(q_r, kv_r, g, PART_R, k_ready, acc_s)
        elif tile_ready:
            score_tile(q_l, kv_l, g, PART_L, k_ready, acc_s)
            score_tile(q_r, kv_r, g, PART_R, k_ready, acc_s)
            score_tile(q_t, k_t, g, PART_T, k_ready, acc_s)
        else:
            T.wgmma_gemm(q_l, kv_l, acc_s, transpose_B=True)
            T.wgmma_gemm(q_r, kv_r, acc_s, transpose_B=True)
            T.wgmma_gemm(q_t, k_t, acc_s, transpose_B=True)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_s, num_regs=s_regs)  # S is read after the wait, not before

    @T.macro
    def score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s):
        """S = Q K^T over the KV buffer holding block g, once the block has landed (seesaw, tile_ready: per tile, in
        score)."""
        if not seesaw and not tile_ready:
            T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
        trace(0, g, 1)
        if kv_buffer(g) == 0:
            score(q_l, q_r, q_t, kv0_l, kv0_r, k0_t, g, k_ready, acc_s)
        else:
            score(q_l, q_r, q_t, kv1_l, kv1_r, k1_t, g, k_ready, acc_s)

    @T.macro
    def pv_block(p, g, v0, v1, acc_o):
        """acc_o += P V, V being this warpgroup's half of the KV buffer holding block g (tws: O^T += V^T P^T,
        V read MN-major from the same tile, P [rows, tokens] as the K-major B operand)."""
        if transposed:
            if kv_buffer(g) == 0:
                T.gemm(v0, p, acc_o, transpose_A=True, transpose_B=True)
            else:
                T.gemm(v1, p, acc_o, transpose_A=True, transpose_B=True)
        elif kv_buffer(g) == 0:
            T.gemm(p, v0, acc_o)
        else:
            T.gemm(p, v1, acc_o)

    @T.macro
    def mask_scale(acc_s, pos0, vis0, row0, scale_log2):
        """Scale S to the log2 domain; -inf where the causal / length rule hides a position."""
        if pos0 + block_n <= vis0 + row0 // num_heads:
            # every position of the block is visible to every row of the tile
            for i, j in T.Parallel(block_rows, block_n):
                acc_s[i, j] = acc_s[i, j] * scale_log2
        else:
            for i, j in T.Parallel(block_rows, block_n):
                acc_s[i, j] = T.if_then_else(pos0 + j < vis0 + (row0 + i) // num_heads,
                                             acc_s[i, j] * scale_log2, -T.infinity(accum))

    @T.macro
    def pv_quarters(p, v, acc0, acc1, acc2, acc3):
        """tws WG1: O^T[256:] += V^T P^T as four 64-dim WGMMA tiles (see the allocation), one wait."""
        T.wgmma_gemm(v[:, 0:TWS_TILE], p, acc0, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, TWS_TILE:2 * TWS_TILE], p, acc1, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, 2 * TWS_TILE:3 * TWS_TILE], p, acc2, transpose_A=True, transpose_B=True)
        T.wgmma_gemm(v[:, 3 * TWS_TILE:HALF], p, acc3, transpose_A=True, transpose_B=True)
        T.wait_wgmma(0)

    @T.macro
    def mask_scale_t(acc_s, pos0, vis0, scale_log2):
        """tws: mask_scale on S^T (tokens x rows; one row block, row0 = 0)."""
        if pos0 + block_n <= vis0:
            for j, i in T.Parallel(block_n, q_rows):
                acc_s[j, i] = acc_s[j, i] * scale_log2
        else:
            for j, i in T.Parallel(block_n, q_rows):
                acc_s[j, i] = T.if_then_else(pos0 + j < vis0 + i // num_heads, acc_s[j, i] * scale_log2,
                                             -T.infinity(accum))

    @T.macro
    def zero_pad_rows(q_l, q_r, q_t, row0, barrier_id):
        """Rows past `rows` (last row block only) stay zero in Q for the whole program: the producer only
        ever writes the valid rows (disjoint bytes). Generic stores read by WGMMA (async proxy): fence,
        then every warp of this warpgroup has its zeros in place before its first WGMMA."""
        for i, d in T.Parallel(q_rows, HALF):
            if row0 + i >= rows:
                q_l[i, d] = T.cast(0, cdtype)
                q_r[i, d] = T.cast(0, cdtype)
        for i, d in T.Parallel(q_rows, ROPE_DIM):
            if row0 + i >= rows:
                q_t[i, d] = T.cast(0, cdtype)
        T.fence_proxy_async()
        T.sync_threads(barrier_id, 128)

    @T.macro
    def q_bf16_to_f16(q_l, q_r, q_t, t):
        """WG0, after q_ready: the segment's bf16 Q (copied bit for bit into the fp16 tiles) -> fp16 x 2^-8,
        in place, 16 bytes per call; padding rows are zeros in both formats. Then as in zero_pad_rows."""
        for m in T.serial(q_rows // 4):
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16", T.access_ptr(q_l[m * 4 + t // 32, (t % 32) * 8], "rw", 8)))
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16", T.access_ptr(q_r[m * 4 + t // 32, (t % 32) * 8], "rw", 8)))
        for m in T.serial(q_rows // 16):
            T.evaluate(T.call_extern("handle", "mla_bf16x8_to_f16", T.access_ptr(q_t[m * 16 + t // 8, (t % 8) * 8], "rw", 8)))
        T.fence_proxy_async()
        T.sync_threads(WG0_NAMED_BARRIER, 128)

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

    def rescale_needed(alpha_frag):
        """ws consumers: some row of this thread has alpha != 1 (the m64 accumulator layout gives a thread 2 rows)."""
        return T.call_extern("int32", "mla_rescale_needed", alpha_frag.data, 2) != 0

    @T.macro
    def rescale_rows(acc, alpha_frag):
        """ws consumers: acc [64 rows, 256] *= alpha per row, skipped where this thread's rows all have alpha 1."""
        if rescale_needed(alpha_frag):
            for i, d in T.Parallel(block_rows, HALF):
                acc[i, d] *= alpha_frag[i]

    @T.macro
    def exchange_l(l_part, l_mine, l_other, l_ready, l_free, seg):
        """Seesaw epilogue: each consumer holds the row sums of the P tiles it made; both need the total."""
        T.barrier_wait(l_free[0], seg_free_parity(seg))
        for i in T.Parallel(block_rows):
            l_mine[i] = l_part[i]
        T.barrier_arrive(l_ready[0])
        T.barrier_wait(l_ready[0], seg_ready_parity(seg))
        for i in T.Parallel(block_rows):
            l_part[i] = l_part[i] + l_other[i]
        T.barrier_arrive(l_free[0])

    @T.prim_func
    def mla_decode_split(
        q_nope: T.StridedTensor([num_tokens, num_heads, KV_LORA_RANK], q_nope_stride, dtype),
        q_pe: T.StridedTensor([num_tokens, num_heads, ROPE_DIM], q_pe_stride, dtype),
        kv_cache: T.Tensor([num_pages, page_size, HEAD_DIM], kv_dtype),
        k_scale: T.Tensor([1], accum),
        page_table: T.Tensor([num_entries], "int32"),
        page_table_start: T.Tensor([batch], "int32"),
        kv_lens: T.Tensor([batch], "int32"),
        qo_indptr: T.Tensor([batch + 1], "int32"),
        cu_blocks: T.Tensor([batch + 1], "int32"),
        part_begin_req: T.Tensor([num_parts], "int32"),
        part_end_req: T.Tensor([num_parts], "int32"),
        blocks_per_part: T.Tensor([1], "int32"),
        sm_scale: T.Tensor([1], accum),
        out: T.Tensor([num_tokens, num_heads, KV_LORA_RANK], dtype),
        lse: T.Tensor([num_tokens, num_heads], accum),
        out_partial: T.Tensor([num_slots, rows, KV_LORA_RANK], accum),
        lse_partial: T.Tensor([num_slots, rows], accum),
        merge_count: T.Tensor([num_counts], "int32"),
    ):
        prelude = PRELUDE + (trace_prelude(cfg.trace_part) if tracing else "")
        with T.Kernel(num_parts, n_row_blocks, threads=threads, prelude=prelude,
                      cluster_dims=(1, 2, 1) if cluster else None) as (part, row_block):
            q_l = T.alloc_shared([q_rows, HALF], cdtype)
            q_r = T.alloc_shared([q_rows, HALF], cdtype)
            q_t = T.alloc_shared([q_rows, ROPE_DIM], cdtype)
            kv0_l = T.alloc_shared([block_n, HALF], cdtype)
            kv0_r = T.alloc_shared([block_n, HALF], cdtype)
            k0_t = T.alloc_shared([block_n, ROPE_DIM], cdtype)
            kv1_l = T.alloc_shared([block_n, HALF], cdtype)
            kv1_r = T.alloc_shared([block_n, HALF], cdtype)
            k1_t = T.alloc_shared([block_n, ROPE_DIM], cdtype)
            p_shared = T.alloc_shared([q_rows, block_n], cdtype)
            colmax_s = T.alloc_shared([128], accum)  # tws WG0: the column-max exchange, 2 x 64
            alpha_shared = T.alloc_shared([q_rows], accum)
            alpha_slots = T.alloc_shared([2 * block_rows], accum) if rs_pv else None  # rs_pv: alpha, by alpha_slot
            p_frag = T.alloc_fragment([block_rows, block_n], cdtype) if rs_pv else None
            # l of WG0's rows for WG1 (with in_merge also m, after it)
            l_shared = T.alloc_shared([2 * q_rows if in_merge else q_rows], accum)
            if in_merge:
                ticket_slots = T.alloc_shared([2], "int32")  # a program's tickets: its first / last segment's
                ticket_ready = T.alloc_barrier([1, 1])  # one per slot: thread 0 has written it
                merge_ticket = (ticket_slots, ticket_ready)
                merge_state = T.alloc_local([2], "int32")  # [ticket, 1 when this program merges the request]
                m_r = T.alloc_fragment([q_rows], accum)  # WG1: WG0's row max
                w_r = T.alloc_local([4], accum)  # WG1: the other part's merge weights (only the PRELUDE helpers index it)
            else:
                merge_ticket = merge_state = m_r = w_r = None

            # S (rows x tokens) and O (rows x dims); tws: S^T and O^T
            acc_s = T.alloc_fragment([block_n, q_rows] if transposed else [block_rows, block_n], accum)
            acc_o_l = T.alloc_fragment([HALF, q_rows] if transposed else [block_rows, HALF], accum)
            if transposed:
                l_acc = T.alloc_fragment([block_n, q_rows], accum)  # WG0: per-thread partial column sums of P
                # WG1's O^T as four 64-dim tiles: TileLang 0.1.9 gives a [256, 16] accumulator of the second
                # warpgroup a thread-dependent register index (nvcc puts it in local memory); 64 rows do not
                acc_o_r0 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r1 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r2 = T.alloc_fragment([TWS_TILE, q_rows], accum)
                acc_o_r3 = T.alloc_fragment([TWS_TILE, q_rows], accum)
            else:
                acc_o_r = T.alloc_fragment([block_rows, HALF], accum)
            m_prev = T.alloc_fragment([q_rows], accum)
            m_cur = T.alloc_fragment([q_rows], accum)
            alpha = T.alloc_fragment([q_rows], accum)
            if not transposed:  # tws keeps per-thread sums (l_acc) instead
                row_sum = T.alloc_fragment([q_rows], accum)
            l_sum = T.alloc_fragment([q_rows], accum)
            l_r = T.alloc_fragment([q_rows], accum)
            alpha_r = T.alloc_fragment([q_rows], accum)
            raw = T.alloc_local([9 * fp8_rows, 16], kv_dtype)  # producer, fp8 cache only: 9 chunks per row
            # producer: the pages of its rows of a block (fp8: 2 rows of the next block; 16-bit: 4 rows)
            pages = T.alloc_local([2 if is_fp8 else block_n // 16], "int32")
            if seesaw:  # WG1's own S / P / softmax state, and the row maxima / sums the consumers swap
                acc_s_r = T.alloc_fragment([block_rows, block_n], accum)
                p_frag_l = T.alloc_fragment([block_rows, block_n], cdtype)
                p_frag_r = T.alloc_fragment([block_rows, block_n], cdtype)
                m_run_r = T.alloc_fragment([block_rows], accum)
                m_new_r = T.alloc_fragment([block_rows], accum)
                m0_r = T.alloc_fragment([block_rows], accum)
                row_max_r = T.alloc_fragment([block_rows], accum)
                row_sum_r = T.alloc_fragment([block_rows], accum)
                m_big_shared = T.alloc_shared([block_rows], accum)  # M: max after the pair's second block
                l_r_shared = T.alloc_shared([block_rows], accum)
                pc = T.alloc_var("int32")  # block pairs started by this program (per thread)

            if seesaw:  # one barrier per tile of each buffer (part_barrier); one consumer releases each tile
                k_ready = T.alloc_barrier([128] * (2 * N_PARTS))
                k_free = T.alloc_barrier([128] * (2 * N_PARTS))
                pb_ready = T.alloc_barrier(128)  # P_b (in its block's rope tile) and M of a pair written by WG1
            elif tile_ready:  # k_ready per tile (part_barrier), k_free per buffer
                k_ready = T.alloc_barrier([128] * (2 * N_PARTS))
                k_free = (T.alloc_cluster_barrier([256 + 8, 256 + 8]) if cluster  # + one per warp of the pair's consumers
                          else T.alloc_barrier([256, 256]))
            else:
                k_ready = T.alloc_barrier([128, 128])
                k_free = T.alloc_barrier([256, 256])
            q_ready = T.alloc_barrier(128)
            # seesaw: both consumers read Q and swap l (256 arrivals); otherwise WG0 alone reads Q
            q_free = T.alloc_barrier(256 if seesaw else 128)
            p_ready = T.alloc_barrier(128)  # seesaw: P_a (p_shared) and m0 of a pair written by WG0
            p_free = T.alloc_barrier(128)  # seesaw: WG1 done with P_a and m0
            l_ready = T.alloc_barrier(256 if seesaw else 128)
            l_free = T.alloc_barrier(256 if seesaw else 128)

            seg = T.alloc_var("int32")  # non-empty request segments started by this program (per thread)

            tx = T.get_thread_binding()
            wait_for_inputs(cfg.pdl)
            if tracing:
                T.evaluate(T.call_extern("handle", "mla_trace_begin",
                                         T.access_ptr(out_partial[num_slots - 1, 0, 0], "w")))
            row0 = row_block * block_rows
            width = blocks_per_part[0]
            part_lo = part * width
            part_hi = T.min(part_lo + width, cu_blocks[batch])
            kv_scale = k_scale[0]
            scale_log2 = sm_scale[0] * kv_scale * LOG2E * (2.0 ** Q_F16_SHIFT if q_to_f16 else 1.0)

            seg = 0
            if seesaw:
                pc = 0
            if seesaw and tx < 128:
                # ------------------------------------------- seesaw WG0: S and P of a pair's first block, O[:, :256]
                # Pair (a, b) of a segment's blocks (b missing at an odd end), running max m:
                #   WG0: S_a; m0 = max(m, rowmax S_a); P_a = exp2(S_a - m0) -> p_shared (+ m0);
                #        O_L = O_L 2^(m - m0) + P_a V_a[:, :256]          (P_a from registers)
                #   WG1: S_b (beside WG0's S_a); M = max(m0, rowmax S_b); P_b = exp2(S_b - M) -> rope tile of b (+ M);
                #        O_R = (O_R 2^(m - m0) + P_a V_a[:, 256:]) 2^(m0 - M) + P_b V_b[:, 256:]
                #   WG0: O_L = O_L 2^(m0 - M) + P_b V_b[:, :256]           (P_b from shared)
                # Both P tiles exist at once (P_b in b's rope tile, which only S_b reads), so neither softmax waits for
                # the other's GEMMs. Row sums: P_a's here, P_b's in WG1, added in the epilogue. Tile releases:
                # rope of a after S_a, left of a after P_a V_a[:, :256], right of a by WG1 after P_a V_a[:, 256:];
                # rope and left of b after P_b V_b[:, :256], right of b by WG1 after P_b V_b[:, 256:].
                T.set_max_nreg(REGS_SEESAW, 1)
                if pad_rows:
                    zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER)
                for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                    req_lo = cu_blocks[req]
                    req_hi = cu_blocks[req + 1]
                    blk_lo = T.max(part_lo, req_lo) - req_lo
                    blk_hi = T.min(part_hi, req_hi) - req_lo
                    if blk_hi > blk_lo:
                        tok0 = qo_indptr[req]
                        vis0 = kv_lens[req] - q_len + 1  # row r sees positions < vis0 + r // H
                        g0 = segment_first_block(part_lo, req_lo, blk_lo)
                        n_blk = blk_hi - blk_lo
                        n_pairs = (n_blk + 1) // 2
                        T.fill(acc_o_l, 0)
                        T.fill(l_sum, 0)
                        T.fill(m_prev, -T.infinity(accum))  # m: running max
                        T.barrier_wait(q_ready[0], seg_ready_parity(seg))
                        for k in T.serial(n_pairs):
                            ga = g0 + 2 * k
                            score_block(q_l, q_r, q_t, ga, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s)
                            T.barrier_arrive(k_free[part_barrier(ga, PART_T)])  # only S_a reads a's rope tile
                            if k == n_pairs - 1:
                                T.barrier_arrive(q_free[0])  # WG0's last read of this segment's Q
                            mask_scale(acc_s, (blk_lo + 2 * k) * block_n, vis0, row0, scale_log2)
                            T.reduce_max(acc_s, row_sum, dim=1, clear=True)
                            for i in T.Parallel(block_rows):
                                m_cur[i] = T.max(m_prev[i], row_sum[i])  # m0
                                alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1,
                                                          T.exp2(m_prev[i] - m_cur[i]))
                            for i, j in T.Parallel(block_rows, block_n):
                                acc_s[i, j] = T.exp2(acc_s[i, j]
                                                     - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
                            T.reduce_sum(acc_s, row_sum, dim=1)
                            T.copy(acc_s, p_frag_l)
                            T.barrier_wait(p_free[0], pair_free_parity(pc))  # WG1 is done with the last P_a, m0
                            T.copy(p_frag_l, p_shared)
                            for i in T.Parallel(block_rows):
                                alpha_shared[i] = m_cur[i]  # m0 for WG1
                            T.fence_proxy_async()
                            T.barrier_arrive(p_ready[0])
                            for i in T.Parallel(block_rows):
                                l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                            rescale_rows(acc_o_l, alpha)
                            pv_block(p_frag_l, ga, kv0_l, kv1_l, acc_o_l)
                            T.barrier_arrive(k_free[part_barrier(ga, PART_L)])
                            # WG1 has published M (and P_b when the pair has a second block)
                            T.barrier_wait(pb_ready[0], pair_ready_parity(pc))
                            for i in T.Parallel(block_rows):
                                m_prev[i] = m_big_shared[i]
                                alpha[i] = T.if_then_else(m_prev[i] == -T.infinity(accum), 1,
                                                          T.exp2(m_cur[i] - m_prev[i]))
                                l_sum[i] = l_sum[i] * alpha[i]
                            if 2 * k + 1 < n_blk:
                                rescale_rows(acc_o_l, alpha)
                                gb = ga + 1
                                T.barrier_wait(k_ready[part_barrier(gb, PART_L)], kv_ready_parity(gb))
                                if kv_buffer(gb) == 0:
                                    T.gemm(k0_t, kv0_l, acc_o_l)
                                else:
                                    T.gemm(k1_t, kv1_l, acc_o_l)
                                T.barrier_arrive(k_free[part_barrier(gb, PART_T)])
                                T.barrier_arrive(k_free[part_barrier(gb, PART_L)])
                            pc = pc + 1
                        exchange_l(l_sum, l_shared, l_r_shared, l_ready, l_free, seg)
                        store_left.store(acc_o_l, l_sum, m_prev, kv_scale, req_lo // width == (req_hi - 1) // width,
                                   part + req, tok0, row0, out, lse, out_partial, lse_partial)
                        seg = seg + 1
            elif seesaw and tx < 256:
                # ------------------------------------------- seesaw WG1: S and P of a pair's second block, O[:, 256:]
                T.set_max_nreg(REGS_SEESAW, 1)
                if pad_rows:
                    zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER - 1)
                for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                    req_lo = cu_blocks[req]
                    req_hi = cu_blocks[req + 1]
                    blk_lo = T.max(part_lo, req_lo) - req_lo
                    blk_hi = T.min(part_hi, req_hi) - req_lo
                    if blk_hi > blk_lo:
                        tok0 = qo_indptr[req]
                        vis0 = kv_lens[req] - q_len + 1
                        g0 = segment_first_block(part_lo, req_lo, blk_lo)
                        n_blk = blk_hi - blk_lo
                        n_pairs = (n_blk + 1) // 2
                        T.fill(acc_o_r, 0)
                        T.fill(l_r, 0)
                        T.fill(m_run_r, -T.infinity(accum))
                        T.barrier_wait(q_ready[0], seg_ready_parity(seg))
                        for k in T.serial(n_pairs):
                            ga = g0 + 2 * k
                            gb = ga + 1
                            if 2 * k + 1 < n_blk:
                                score_block(q_l, q_r, q_t, gb, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s_r)
                                mask_scale(acc_s_r, (blk_lo + 2 * k + 1) * block_n, vis0, row0, scale_log2)
                                T.reduce_max(acc_s_r, row_max_r, dim=1, clear=True)
                            else:
                                T.fill(row_max_r, -T.infinity(accum))
                            if k == n_pairs - 1:
                                T.barrier_arrive(q_free[0])  # WG1's last read of this segment's Q
                            T.barrier_wait(p_ready[0], pair_ready_parity(pc))  # P_a and m0 from WG0
                            for i in T.Parallel(block_rows):
                                m0_r[i] = alpha_shared[i]
                                m_new_r[i] = T.max(m0_r[i], row_max_r[i])  # M
                                alpha_r[i] = T.if_then_else(m0_r[i] == -T.infinity(accum), 1,
                                                            T.exp2(m_run_r[i] - m0_r[i]))
                                l_r[i] = l_r[i] * alpha_r[i]
                            if 2 * k + 1 < n_blk:
                                for i, j in T.Parallel(block_rows, block_n):
                                    acc_s_r[i, j] = T.exp2(acc_s_r[i, j] - T.if_then_else(
                                        m_new_r[i] == -T.infinity(accum), 0, m_new_r[i]))
                                T.reduce_sum(acc_s_r, row_sum_r, dim=1)
                                T.copy(acc_s_r, p_frag_r)
                                # P_b into b's rope tile: S_b (waited above) was its only reader
                                if kv_buffer(gb) == 0:
                                    T.copy(p_frag_r, k0_t)
                                else:
                                    T.copy(p_frag_r, k1_t)
                            else:
                                T.fill(row_sum_r, 0)
                            for i in T.Parallel(block_rows):
                                m_big_shared[i] = m_new_r[i]
                            T.fence_proxy_async()
                            T.barrier_arrive(pb_ready[0])
                            rescale_rows(acc_o_r, alpha_r)
                            T.barrier_wait(k_ready[part_barrier(ga, PART_R)], kv_ready_parity(ga))
                            pv_block(p_shared, ga, kv0_r, kv1_r, acc_o_r)
                            T.barrier_arrive(p_free[0])
                            T.barrier_arrive(k_free[part_barrier(ga, PART_R)])
                            for i in T.Parallel(block_rows):
                                alpha_r[i] = T.if_then_else(m_new_r[i] == -T.infinity(accum), 1,
                                                            T.exp2(m0_r[i] - m_new_r[i]))
                                l_r[i] = l_r[i] * alpha_r[i] + row_sum_r[i]
                                m_run_r[i] = m_new_r[i]
                            if 2 * k + 1 < n_blk:
                                rescale_rows(acc_o_r, alpha_r)
                                pv_block(p_frag_r, gb, kv0_r, kv1_r, acc_o_r)
                                T.barrier_arrive(k_free[part_barrier(gb, PART_R)])
                            pc = pc + 1
                        exchange_l(l_r, l_r_shared, l_shared, l_ready, l_free, seg)
                        store_right.store(acc_o_r, l_r, l_r, kv_scale, req_lo // width == (req_hi - 1) // width,
                                    part + req, tok0, row0, out, lse, out_partial, lse_partial)
                        seg = seg + 1
            elif tx < 128:
                if transposed:
                    # ------------------------------------------------ tws WG0: S^T, softmax down columns, P, O^T[:256]
                    # Same protocol as WG0 below; the running max is a cross-warp reduction per block, the row
                    # sums stay per thread (l_acc, rescaled like O) until the segment's end.
                    T.set_max_nreg(regs_wg0, grows(regs_wg0, threads))
                    if pad_rows:
                        zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER)
                    for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                        req_lo = cu_blocks[req]
                        req_hi = cu_blocks[req + 1]
                        blk_lo = T.max(part_lo, req_lo) - req_lo
                        blk_hi = T.min(part_hi, req_hi) - req_lo
                        if blk_hi > blk_lo:
                            tok0 = qo_indptr[req]
                            vis0 = kv_lens[req] - q_len + 1  # row r sees positions < vis0 + r // H
                            g0 = segment_first_block(part_lo, req_lo, blk_lo)
                            n_blk = blk_hi - blk_lo
                            T.fill(acc_o_l, 0)
                            T.fill(l_acc, 0)
                            T.fill(m_cur, -T.infinity(accum))
                            T.barrier_wait(q_ready[0], seg_ready_parity(seg))
                            if q_to_f16:
                                q_bf16_to_f16(q_l, q_r, q_t, tx)
                            for blk in T.serial(n_blk):
                                g = g0 + blk
                                score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s)
                                if blk == n_blk - 1:
                                    T.barrier_arrive(q_free[0])
                                mask_scale_t(acc_s, (blk_lo + blk) * block_n, vis0, scale_log2)
                                T.copy(m_cur, m_prev)
                                # the scratch by plain address: its two halves alternate by block, so no barrier
                                # is needed before the write (TileLang's thread-sync pass would add one)
                                T.evaluate(T.call_extern("handle", "mla_colmax4", acc_s.data,
                                                         m_cur.data, T.address_of(colmax_s[0]), g & 1))
                                for i in T.Parallel(q_rows):
                                    alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1,
                                                              T.exp2(m_prev[i] - m_cur[i]))
                                for j, i in T.Parallel(block_n, q_rows):
                                    acc_s[j, i] = T.exp2(acc_s[j, i]
                                                         - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
                                    l_acc[j, i] = l_acc[j, i] * alpha[i] + acc_s[j, i]
                                T.barrier_wait(p_free[0], p_free_parity(g))
                                for i in T.Parallel(q_rows):
                                    alpha_shared[i] = alpha[i]
                                for j, i in T.Parallel(block_n, q_rows):
                                    p_shared[i, j] = acc_s[j, i]
                                T.fence_proxy_async()
                                T.barrier_arrive(p_ready[0])
                                for d, i in T.Parallel(HALF, q_rows):
                                    acc_o_l[d, i] *= alpha[i]
                                pv_block(p_shared, g, kv0_l, kv1_l, acc_o_l)
                                T.barrier_arrive(k_free[kv_buffer(g)])

                            T.reduce_sum(l_acc, l_sum, dim=0)
                            T.barrier_wait(l_free[0], seg_free_parity(seg))
                            for i in T.Parallel(q_rows):
                                l_shared[i] = l_sum[i]
                            if in_merge:
                                for i in T.Parallel(q_rows):
                                    l_shared[q_rows + i] = m_cur[i]
                            T.barrier_arrive(l_ready[0])
                            first, n_parts = request_parts(req_lo, req_hi, width)
                            wg0_store_segment(acc_o_l, l_sum, m_cur, alpha, m_prev, m_prev, kv_scale, first, n_parts,
                                              part, req, row_block, row0, tok0, merge_count, merge_ticket, merge_state,
                                              out, lse, out_partial, lse_partial)
                            seg = seg + 1
                else:
                    # ------------------------------------------------ WG0: S, softmax, P, O[:, :256]
                    T.set_max_nreg(REGS_WG0, 1)
                    if pad_rows:
                        zero_pad_rows(q_l, q_r, q_t, row0, WG0_NAMED_BARRIER)  # WG0 is Q's only reader
                    for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                        req_lo = cu_blocks[req]
                        req_hi = cu_blocks[req + 1]
                        blk_lo = T.max(part_lo, req_lo) - req_lo
                        blk_hi = T.min(part_hi, req_hi) - req_lo
                        if blk_hi > blk_lo:
                            kv_len = kv_lens[req]
                            tok0 = qo_indptr[req]
                            vis0 = kv_len - q_len + 1  # row r sees positions < vis0 + r // H
                            g0 = segment_first_block(part_lo, req_lo, blk_lo)  # g of the segment's first block
                            n_blk = blk_hi - blk_lo
                            T.fill(acc_o_l, 0)
                            T.fill(l_sum, 0)
                            T.fill(m_cur, -T.infinity(accum))
                            T.barrier_wait(q_ready[0], seg_ready_parity(seg))
                            if q_to_f16:
                                q_bf16_to_f16(q_l, q_r, q_t, tx)
                            for blk in T.serial(n_blk):
                                g = g0 + blk
                                pos0 = (blk_lo + blk) * block_n
                                trace(0, g, 0)
                                score_block(q_l, q_r, q_t, g, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t, k_ready, acc_s)
                                trace(0, g, 2)
                                if blk == n_blk - 1:
                                    T.barrier_arrive(q_free[0])  # last read of this segment's Q
                                if pfree_early:  # WG1's P V (g - 1) ran before S (g) on the tensor pipe: no wait
                                    T.barrier_wait(p_free[0], p_free_parity(g))
                                # scale_in_exp: S stays raw (scale 1 here) until the row max and P's exp2 apply it
                                mask_scale(acc_s, pos0, vis0, row0, T.float32(1.0) if scale_in_exp else scale_log2)
                                T.copy(m_cur, m_prev)
                                if tree_max:
                                    T.evaluate(T.call_extern("handle", "mla_row_max2", acc_s.data, m_cur.data,
                                                             scale_log2 if scale_in_exp else T.float32(1.0)))
                                else:
                                    T.reduce_max(acc_s, m_cur, dim=1, clear=False)
                                # A row that has seen nothing yet keeps max -inf: offset by 0 instead, so
                                # exp2 gives 0, not NaN.
                                for i in T.Parallel(block_rows):
                                    alpha[i] = T.if_then_else(m_cur[i] == -T.infinity(accum), 1,
                                                              T.exp2(m_prev[i] - m_cur[i]))
                                if rescale_early:
                                    for i, d in T.Parallel(block_rows, HALF):
                                        acc_o_l[i, d] *= alpha[i]
                                for i, j in T.Parallel(block_rows, block_n):
                                    acc_s[i, j] = T.exp2(acc_s[i, j] * (scale_log2 if scale_in_exp else T.float32(1.0))
                                                         - T.if_then_else(m_cur[i] == -T.infinity(accum), 0, m_cur[i]))
                                if not pv_first:
                                    T.reduce_sum(acc_s, row_sum, dim=1)
                                    for i in T.Parallel(block_rows):
                                        l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                                if rs_pv:
                                    T.copy(acc_s, p_frag)
                                    if not pv_first and not rescale_early:
                                        rescale_rows(acc_o_l, alpha)
                                    # alpha's slot was last read by WG1 for block g - 2, before the p_free arrival
                                    # WG0 waited for at block g - 1. Plain-address stores: TileLang's thread-sync
                                    # pass would put a barrier of the warpgroup around each of them.
                                    T.evaluate(T.call_extern("handle", "mla_store_rows64",
                                                             alpha_slots.access_ptr("r", offset=alpha_slot(g) * block_rows)
                                                             if pv_early else
                                                             T.address_of(alpha_slots[alpha_slot(g) * block_rows]),
                                                             alpha.data))
                                    # WG1 has finished with P of block g - 1
                                    trace(0, g, 3)
                                    if not pfree_early:
                                        T.barrier_wait(p_free[0], p_free_parity(g))
                                    trace(0, g, 4)
                                    # pv_early: a read-only access_ptr, or TileLang's fence-proxy pass would take the
                                    # call for a generic write and fence it before WG0's GEMM (the fence follows it)
                                    T.evaluate(T.call_extern("handle", "mla_store_p64",
                                                             p_shared.access_ptr("r") if pv_early
                                                             else T.address_of(p_shared[0, 0]), p_frag.data))
                                    if pv_first and not pv_early:  # P goes to WG1 before WG0's own P V is issued
                                        T.fence_proxy_async()
                                        T.barrier_arrive(p_ready[0])
                                        trace(0, g, 5)
                                    if pv_first and not rescale_early:
                                        rescale_rows(acc_o_l, alpha)
                                    if kv_buffer(g) == 0:
                                        T.wgmma_gemm(p_frag, kv0_l, acc_o_l)
                                    else:
                                        T.wgmma_gemm(p_frag, kv1_l, acc_o_l)
                                    if pv_early:  # the fence waits for P's stores, now behind WG0's GEMM
                                        T.fence_proxy_async()
                                        T.barrier_arrive(p_ready[0])
                                        trace(0, g, 5)
                                    if pv_first:  # the row sums (this thread's share) while the tensor cores run
                                        T.evaluate(T.call_extern("handle", "mla_row_sum_part", acc_s.data,
                                                                 row_sum.data))
                                        for i in T.Parallel(block_rows):
                                            l_sum[i] = l_sum[i] * alpha[i] + row_sum[i]
                                    else:
                                        T.fence_proxy_async()  # P: generic stores, read by WG1's WGMMA (async proxy)
                                        T.barrier_arrive(p_ready[0])
                                    trace(0, g, 6)
                                    T.wait_wgmma(0)
                                    T.warpgroup_fence_operand(acc_o_l, num_regs=block_rows * HALF // 128)
                                    trace(0, g, 7)
                                else:
                                    # WG1 has finished with P / alpha of block g - 1
                                    T.barrier_wait(p_free[0], p_free_parity(g))
                                    for i in T.Parallel(block_rows):
                                        alpha_shared[i] = alpha[i]
                                    T.copy(acc_s, p_shared)
                                    T.fence_proxy_async()  # P: generic stores, read by WGMMA (async proxy)
                                    T.barrier_arrive(p_ready[0])
                                    rescale_rows(acc_o_l, alpha)
                                    pv_block(p_shared, g, kv0_l, kv1_l, acc_o_l)
                                release_kv(k_free, g, tx)

                            if pv_first:  # each thread held its share of the row sums
                                T.evaluate(T.call_extern("handle", "mla_quad_sum2", l_sum.data))
                            # epilogue: hand l (and m) to WG1, merge the request's parts if this program is the last
                            # of a few, write O[:, :256] and the LSE
                            T.barrier_wait(l_free[0], seg_free_parity(seg))
                            for i in T.Parallel(block_rows):
                                l_shared[i] = l_sum[i]
                            if in_merge:
                                for i in T.Parallel(block_rows):
                                    l_shared[block_rows + i] = m_cur[i]
                            T.barrier_arrive(l_ready[0])
                            first, n_parts = request_parts(req_lo, req_hi, width)
                            wg0_store_segment(acc_o_l, l_sum, m_cur, alpha, m_prev, m_prev, kv_scale, first, n_parts,
                                              part, req, row_block, row0, tok0, merge_count, merge_ticket, merge_state,
                                              out, lse, out_partial, lse_partial)
                            seg = seg + 1
                    trace_end(0)
            elif tx < 256:
                if transposed:
                    # ------------------------------------------------ tws WG1: O^T[256:]
                    T.set_max_nreg(regs_wg1, grows(regs_wg1, threads))
                    for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                        req_lo = cu_blocks[req]
                        req_hi = cu_blocks[req + 1]
                        blk_lo = T.max(part_lo, req_lo) - req_lo
                        blk_hi = T.min(part_hi, req_hi) - req_lo
                        if blk_hi > blk_lo:
                            tok0 = qo_indptr[req]
                            g0 = segment_first_block(part_lo, req_lo, blk_lo)
                            T.fill(acc_o_r0, 0)
                            T.fill(acc_o_r1, 0)
                            T.fill(acc_o_r2, 0)
                            T.fill(acc_o_r3, 0)
                            for blk in T.serial(blk_hi - blk_lo):
                                g = g0 + blk
                                T.barrier_wait(k_ready[kv_buffer(g)], kv_ready_parity(g))
                                T.barrier_wait(p_ready[0], p_ready_parity(g))
                                for i in T.Parallel(q_rows):
                                    alpha_r[i] = alpha_shared[i]
                                for d, i in T.Parallel(TWS_TILE, q_rows):
                                    acc_o_r0[d, i] *= alpha_r[i]
                                    acc_o_r1[d, i] *= alpha_r[i]
                                    acc_o_r2[d, i] *= alpha_r[i]
                                    acc_o_r3[d, i] *= alpha_r[i]
                                if kv_buffer(g) == 0:
                                    pv_quarters(p_shared, kv0_r, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3)
                                else:
                                    pv_quarters(p_shared, kv1_r, acc_o_r0, acc_o_r1, acc_o_r2, acc_o_r3)
                                T.barrier_arrive(p_free[0])
                                T.barrier_arrive(k_free[kv_buffer(g)])

                            T.barrier_wait(l_ready[0], seg_ready_parity(seg))
                            for i in T.Parallel(q_rows):
                                l_r[i] = l_shared[i]
                            if in_merge:
                                for i in T.Parallel(q_rows):
                                    m_r[i] = l_shared[q_rows + i]
                            T.barrier_arrive(l_free[0])
                            first, n_parts = request_parts(req_lo, req_hi, width)
                            store_right_t[0].normalize(acc_o_r0, l_r, kv_scale, alpha_r)
                            store_right_t[1].normalize(acc_o_r1, l_r, kv_scale, alpha_r)
                            store_right_t[2].normalize(acc_o_r2, l_r, kv_scale, alpha_r)
                            store_right_t[3].normalize(acc_o_r3, l_r, kv_scale, alpha_r)
                            if in_merge:
                                merge_begin(merge_count, merge_ticket, req, row_block, first, part, n_parts, merge_state)
                                if merge_state[1] == 1:
                                    other = merge_other(first, part, req)
                                    merge_weights(l_r, m_r, alpha_r, w_r, other, row0, lse_partial)
                                    merge_add(acc_o_r0, alpha_r, w_r, other, row0, HALF, out_partial, 1)
                                    merge_add(acc_o_r1, alpha_r, w_r, other, row0, HALF + TWS_TILE, out_partial, 1)
                                    merge_add(acc_o_r2, alpha_r, w_r, other, row0, HALF + 2 * TWS_TILE, out_partial, 1)
                                    merge_add(acc_o_r3, alpha_r, w_r, other, row0, HALF + 3 * TWS_TILE, out_partial, 1)
                                    store_right_t[0].normalize(acc_o_r0, l_r, T.float32(1), alpha_r)
                                    store_right_t[1].normalize(acc_o_r1, l_r, T.float32(1), alpha_r)
                                    store_right_t[2].normalize(acc_o_r2, l_r, T.float32(1), alpha_r)
                                    store_right_t[3].normalize(acc_o_r3, l_r, T.float32(1), alpha_r)
                            direct = store_direct(n_parts, merge_state)
                            store_right_t[0].write(acc_o_r0, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                                   out_partial, lse_partial)
                            store_right_t[1].write(acc_o_r1, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                                   out_partial, lse_partial)
                            store_right_t[2].write(acc_o_r2, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                                   out_partial, lse_partial)
                            store_right_t[3].write(acc_o_r3, l_r, l_r, direct, part + req, tok0, row0, out, lse,
                                                   out_partial, lse_partial)
                            if in_merge:
                                merge_end(merge_count, req, row_block, n_parts, merge_state)
                            seg = seg + 1
                else:
                    # ------------------------------------------------ WG1: O[:, 256:]
                    T.set_max_nreg(regs_wg1, grows(regs_wg1, threads))  # fp8's 160 is a .dec
                    for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                        req_lo = cu_blocks[req]
                        req_hi = cu_blocks[req + 1]
                        blk_lo = T.max(part_lo, req_lo) - req_lo
                        blk_hi = T.min(part_hi, req_hi) - req_lo
                        if blk_hi > blk_lo:
                            tok0 = qo_indptr[req]
                            g0 = segment_first_block(part_lo, req_lo, blk_lo)
                            T.fill(acc_o_r, 0)
                            for blk in T.serial(blk_hi - blk_lo):
                                g = g0 + blk
                                trace(1, g, 0)
                                # its V half (tile_ready: that tile's own barrier)
                                T.barrier_wait(k_ready[part_barrier(g, PART_R) if tile_ready else kv_buffer(g)],
                                               kv_ready_parity(g))
                                trace(1, g, 1)
                                T.barrier_wait(p_ready[0], p_ready_parity(g))
                                trace(1, g, 2)
                                for i in T.Parallel(block_rows):
                                    alpha_r[i] = (alpha_slots[alpha_slot(g) * block_rows + i] if rs_pv
                                                  else alpha_shared[i])
                                rescale_rows(acc_o_r, alpha_r)
                                pv_block(p_shared, g, kv0_r, kv1_r, acc_o_r)
                                trace(1, g, 3)
                                T.barrier_arrive(p_free[0])
                                release_kv(k_free, g, tx)

                            T.barrier_wait(l_ready[0], seg_ready_parity(seg))
                            for i in T.Parallel(block_rows):
                                l_r[i] = l_shared[i]
                            if in_merge:
                                for i in T.Parallel(block_rows):
                                    m_r[i] = l_shared[block_rows + i]
                            T.barrier_arrive(l_free[0])
                            first, n_parts = request_parts(req_lo, req_hi, width)
                            wg1_store_segment(acc_o_r, l_r, m_r, alpha_r, w_r, alpha_r, kv_scale, first, n_parts, part,
                                              req, row_block, row0, tok0, merge_count, merge_ticket, merge_state, out,
                                              lse, out_partial, lse_partial)
                            seg = seg + 1
                    trace_end(1)
            else:
                # ------------------------------------------------ WG2: producer
                T.set_max_nreg(regs_producer, grows(regs_producer, threads))
                t = tx - 256 if n_producers == 1 else (tx - 256) % 128
                pw = (tx - 256) // 128  # producer warpgroup (rr_fp8: it converts the blocks g with g % n == pw)
                if cluster_rope and part_hi < part_lo:
                    # never taken: with every tile multicast, this tma_copy is what makes TileLang pass the cache's
                    # tensor map (kv_cache_desc), which MLA_TMA_MC issues through
                    T.tma_copy(kv_cache[0, 0:block_n, KV_LORA_RANK:HEAD_DIM], k0_t, barrier=k_ready[0])
                for req in T.serial(part_begin_req[part], part_end_req[part] + 1):
                    req_lo = cu_blocks[req]
                    req_hi = cu_blocks[req + 1]
                    blk_lo = T.max(part_lo, req_lo) - req_lo
                    blk_hi = T.min(part_hi, req_hi) - req_lo
                    if blk_hi > blk_lo:
                        kv_len = kv_lens[req]
                        tok0 = qo_indptr[req]
                        pt0 = page_table_start[req]
                        g0 = segment_first_block(part_lo, req_lo, blk_lo)
                        produce_segment(q_nope, q_pe, kv_cache, page_table, pt0, kv_len, tok0, row0, blk_lo, blk_hi,
                                        g0, seg, pw, pages, raw, q_l, q_r, q_t, kv0_l, kv0_r, k0_t, kv1_l, kv1_r, k1_t,
                                        q_free, q_ready, k_free, k_ready, t)
                        seg = seg + 1
                if rr_fp8:
                    # Tail: producer 0's last Q copies have landed (the others issue no cp.async). Not the part's
                    # last k_ready as below: a producer done early may be two fills ahead of that barrier.
                    if pw == 0 and seg > 0:
                        T.barrier_wait(q_ready[0], seg_ready_parity(seg - 1))
                elif part_hi > part_lo:
                    # Tail: no producer thread exits with cp.async in flight. With only cp.async gathers the part's
                    # last copy's k_ready phase is enough (seesaw: the last block's right tile): it completes once all
                    # 128 producer threads' copies have landed (a noinc arrival waits for all of its thread's earlier
                    # cp.async, Q included). A TMA block's phase (bytes + plain arrivals) or an fp8 block's
                    # (registers, plain arrivals) waits for none of them: then also the block before (a gather,
                    # maybe) and the last segment's Q. (cp.async.wait_group would make TileLang add a named barrier
                    # whose id collides with WG0's.)
                    if tma_kv and part_hi - part_lo > 1:
                        T.barrier_wait(k_ready[last_copy_barrier(part_hi - part_lo - 2)],
                                       kv_ready_parity(part_hi - part_lo - 2))
                    T.barrier_wait(k_ready[last_copy_barrier(part_hi - part_lo - 1)],
                                   kv_ready_parity(part_hi - part_lo - 1))
                    if tma_kv or is_fp8:
                        T.barrier_wait(q_ready[0], seg_ready_parity(seg - 1))
                trace_end(2)
            if cluster:  # no CTA exits while its pair may still copy into it or arrive on its k_free
                T.cluster_sync()

    return mla_decode_split


def build_decode_kernel(num_heads: int, q_len: int, page_size: int, dtype: str, kv_dtype: str,
                        cfg: KernelConfig = SM90_WS):
    """Same name and parameters as ``mla_decode.build_decode_kernel`` (for a config-driven swap)."""
    return build_decode_kernel_ws(num_heads, q_len, page_size, dtype, kv_dtype, cfg)
