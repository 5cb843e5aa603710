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
