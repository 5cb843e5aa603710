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
// The warpgroup-relative thread index, read by volatile asm so that no address computed from it is hoisted out of a
// loop into a register held across it.
__device__ __forceinline__ int mla_wg_thread() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t & 127;
}
