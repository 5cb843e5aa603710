// fp8 compute (kernels/sm90/fp8c.py), pasted after prelude.cuh. Q quantised to e4m3 per row by the producer, 8
// threads per row, each holding 9 chunks of 8 16-bit values (72 of the row's 576).
template <bool kBF16>
__device__ __forceinline__ float mla_f16x2_lo(unsigned w) {
  if (kBF16) return __uint_as_float(w << 16);
  float f;  // the prelude precedes cuda_fp16.h
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(w & 0xFFFFu)));
  return f;
}
template <bool kBF16>
__device__ __forceinline__ float mla_f16x2_hi(unsigned w) {
  if (kBF16) return __uint_as_float(w & 0xFFFF0000u);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(w >> 16)));
  return f;
}
// Returns 448 / amax(|row|) (1 for a row of zeros) after a reduction over the row's 8 lanes; where ``store``, lane 0
// of the row writes the row's dequantisation scale amax / 448.
template <bool kBF16>
__device__ __forceinline__ float mla_q8_inv_scale(const void* q, float* scale, int store) {
  // the largest magnitude by integer max over the 16-bit lanes (sign cleared: magnitudes order as their bits), so
  // no value is converted twice and the 72 values never live as floats
  const unsigned* w = reinterpret_cast<const unsigned*>(q);
  unsigned m = 0u;
#pragma unroll
  for (int k = 0; k < 36; ++k) m = __vmaxu2(m, w[k] & 0x7FFF7FFFu);
  m = max(m & 0xFFFFu, m >> 16);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 4));
  const float amax = mla_f16x2_lo<kBF16>(m);
  if (store && (threadIdx.x & 7) == 0) *scale = amax > 0.0f ? amax * (1.0f / 448.0f) : 1.0f;
  return amax > 0.0f ? 448.0f / amax : 1.0f;
}
// 8 16-bit values at q times inv -> 8 e4m3 bytes at dst (8-byte aligned), rounded to nearest, saturating.
template <bool kBF16>
__device__ __forceinline__ void mla_q8_store8(const void* q, float inv, void* dst) {
  const unsigned* w = reinterpret_cast<const unsigned*>(q);
  unsigned short b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)  // the first operand goes to the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
        : "=h"(b[k]) : "f"(mla_f16x2_hi<kBF16>(w[k]) * inv), "f"(mla_f16x2_lo<kBF16>(w[k]) * inv));
  *reinterpret_cast<uint2*>(dst) = make_uint2(b[0] | (static_cast<unsigned>(b[1]) << 16),
                                              b[2] | (static_cast<unsigned>(b[3]) << 16));
}
// P V as O^T [256 dims, 64 rows] += V^T [256 dims, 64 tokens] P^T (mla_pv8_vt): four m64n64k32 e4m3 WGMMAs per k-step
// with A = V^T from registers (RS) and B = P8 [64 rows, 64 tokens] (K-major, 64-byte swizzle: the layout fp8c.py
// annotates on P8). A rows are dims, so the dims may be permuted: row r of tile i (warp w = r / 16, g = r % 8,
// h = (r / 8) % 2) is dim 64 i + 16 w + 2 g + h, i.e. a thread's two rows (g, g + 8) are the adjacent dims
// d0 = 64 i + 16 w + 2 g, d0 + 1. k8: the consumer's K8 tile [64 tokens, 256 dims] as TileLang lays it out for the S
// WGMMA (two 128-dim atoms of 8192 bytes, rows of 128 bytes, 128-byte swizzle: 16-byte chunk c of row n at chunk
// c ^ (n % 8)). ldmatrix.x4.trans of the warp's 16-byte dim chunk over 32 tokens per k-step (4 matrices of 8 tokens,
// one wavefront each) gives each thread tokens 2q, 2q + 1 of each matrix (q = lane % 4); two byte permutes give A
// registers whose k = 4q + j is token 2q + (j & 1) + 8 (j >> 1) of the 16-token half: P8's columns are stored in the
// same order (mla_p8_store_ldsm), so the product sums over the same tokens.
__device__ __forceinline__ void mla_acc32_fence(float* d) {
#pragma unroll
  for (int v = 0; v < 32; ++v) asm volatile("" : "+f"(d[v]) :: "memory");
}
__device__ __forceinline__ void mla_wgmma_e4m3_rs_64x64x32(float* d, const unsigned* a, unsigned long long desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
// The 4 A registers of tile i, k-step s (tokens 32 s .. 32 s + 31). K8 address of token n, 16-byte dim chunk c (of
// 16): (c / 8) * 8192 + n * 128 + ((c % 8) ^ (n % 8)) * 16. A thread's chunk is c = 4 i + w (tile i, warp w), so with
// base = lane * 128 + (w ^ (lane % 8)) * 16 (the ldmatrix row of token lane) the address is
// (base ^ (i % 2) * 64) + (i / 2) * 8192 + 32 s * 128: one base register, immediates for the rest.
__device__ __forceinline__ void mla_vt_frags(unsigned* a, unsigned base, int i, int s) {
  const unsigned flip = (i & 1) << 6, atom = (i >> 1) * 8192;
  unsigned r0, r1, r2, r3;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"((base ^ flip) + atom + 32 * s * 128));
  a[0] = __byte_perm(r0, r1, 0x6420);  // dim d0: tokens 2q, 2q + 1, 8 + 2q, 9 + 2q
  a[1] = __byte_perm(r0, r1, 0x7531);  // dim d0 + 1
  a[2] = __byte_perm(r2, r3, 0x6420);  // the same, tokens + 16
  a[3] = __byte_perm(r2, r3, 0x7531);
}
// The accumulator is O^T. Float v of tile i (acc[32 i + v]) of thread t (w = t / 32, g = (t % 32) / 4, q = t % 4) is
// dim 64 i + 16 w + 2 g + (v / 2) % 2 (of the consumer's 256) of query row (column) 8 (v / 4) + 2 q + v % 2; a thread's
// 16 columns are mla_ot_col(q, jj), jj = 2 (v / 4) + v % 2.
__device__ __forceinline__ int mla_ot_col(int q, int jj) { return 8 * (jj >> 1) + 2 * q + (jj & 1); }
// dst[jj] = src[column jj of this thread] (src: 64 per-row values in shared memory: alpha or l). Volatile
// loads: they stay ahead of the mbarrier arrive that hands the slots back (TileLang's arrive has no memory clobber).
__device__ __forceinline__ void mla_ot_cols(float* dst, const float* src) {
  const int q = mla_wg_thread() & 3;
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(src + 2 * q));
#pragma unroll
  for (int j = 0; j < 8; ++j)
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(dst[2 * j]), "=f"(dst[2 * j + 1]) : "r"(a + 32 * j));
}
// acc's columns times f[jj]
__device__ __forceinline__ void mla_ot_mul_cols(float* acc, const float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int v = 0; v < 32; ++v) acc[32 * i + v] *= f[2 * (v >> 2) + (v & 1)];
}
// the online-softmax rescale of O^T: column c times alpha[c] (alpha: the block's alpha slot in shared memory)
__device__ __forceinline__ void mla_ot_scale_alpha(float* acc, const float* alpha) {
  float f[16];
  mla_ot_cols(f, alpha);
  mla_ot_mul_cols(acc, f);
}
// normalise: column c times kv_scale / l[c] (0 where l is 0); l: the thread's 16 column sums (mla_ot_cols)
__device__ __forceinline__ void mla_ot_normalize(float* acc, const float* l, float kv_scale) {
  float f[16];
#pragma unroll
  for (int jj = 0; jj < 16; ++jj) f[jj] = l[jj] == 0.f ? 0.f : kv_scale / l[jj];
  mla_ot_mul_cols(acc, f);
}
// O^T to a row-major [rows, 512] destination: dst at row 0 and the consumer's first dim; row row0 + c of column c;
// each float pair (dims d, d + 1 of one row) as one store: kOut 0 fp32 (the partial slot), 1 bf16, 2 fp16.
template <int kOut>
__device__ __forceinline__ void mla_ot_store(const float* acc, void* dst, int row0, int rows_left) {
  const int t = mla_wg_thread(), w = t >> 5, g = (t >> 2) & 7, q = t & 3;
#pragma unroll
  for (int jj = 0; jj < 16; ++jj) {
    const int c = mla_ot_col(q, jj), j = jj >> 1, e = jj & 1;
    if (c < rows_left) {
      const long long row = static_cast<long long>(row0 + c) * 512;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int d = 64 * i + 16 * w + 2 * g;
        const float lo = acc[32 * i + 4 * j + e], hi = acc[32 * i + 4 * j + 2 + e];
        if (kOut == 0) {
          *reinterpret_cast<float2*>(static_cast<float*>(dst) + row + d) = make_float2(lo, hi);
        } else {
          unsigned p;
          if (kOut == 1) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
          else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(hi), "f"(lo));
          *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(dst) + row + d) = p;
        }
      }
    }
  }
}
// WG0's P8 store in the ldmatrix token order. Of each 16-token group m, the thread's four S values of a row (tokens
// 16 m + 2q, + 1, + 8, + 9: accumulator floats 8 m + 2 h + {0, 1, 4, 5}) go times scale to e4m3 as one 32-bit word at
// columns 16 m + 4 q .. + 3 (column 4 q' + j holds token 2 q' + (j & 1) + 8 (j >> 1)), at P8's 64-byte-swizzled
// address (row r: r * 64 + ((column / 16) ^ ((r / 2) % 4)) * 16 + column % 16), which the B descriptor of mla_pv8_vt
// reads. s: the m64n64 S accumulator (row 16 w + g + 8 h, column 8 (v / 4) + 2 q + v % 2).
__device__ __forceinline__ void mla_p8_store_ldsm(const float* s, void* p8, float scale) {
  const int t = mla_wg_thread(), w = t >> 5, g = (t >> 2) & 7, q = t & 3;
  unsigned char* base = static_cast<unsigned char*>(p8);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * w + g + 8 * h;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int v = 8 * m + 2 * h;
      unsigned short lo, hi;  // cvt: the first operand goes to the upper byte
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(s[v + 1] * scale), "f"(s[v] * scale));
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(s[v + 5] * scale), "f"(s[v + 4] * scale));
      *reinterpret_cast<unsigned*>(base + r * 64 + ((m ^ ((r >> 1) & 3)) << 4) + 4 * q) =
          lo | (static_cast<unsigned>(hi) << 16);
    }
  }
}
// One consumer's P V of a block: O^T's columns times the block's alpha (alpha[alpha_offset ..]: its slot), then
// acc += V^T P8^T from its K8 tile k8.
__device__ __forceinline__ void mla_pv8_vt(float* acc, const void* k8, const void* p8, const float* alpha,
                                           int alpha_offset) {
  const unsigned k8s = static_cast<unsigned>(__cvta_generic_to_shared(k8));
  const unsigned p8s = static_cast<unsigned>(__cvta_generic_to_shared(p8));
  // K-major, 64-byte swizzle (layout type 2), LBO 16 bytes (1), SBO 512 bytes (32): P8's 64-byte rows
  const unsigned long long desc =
      static_cast<unsigned long long>((p8s >> 4) & 0x3FFFu) | (1ull << 16) | (32ull << 32) | (2ull << 62);
  // thread index by volatile asm: the base is not hoisted out of the block loop into a register held across it
  const int t = mla_wg_thread(), w = t >> 5, lane = t & 31;
  const unsigned base = k8s + lane * 128 + ((w ^ (lane & 7)) << 4);
  unsigned a[2][4];
  mla_ot_scale_alpha(acc, alpha + alpha_offset);
#pragma unroll
  for (int i = 0; i < 4; ++i) mla_acc32_fence(acc + 32 * i);
  // one WGMMA per (tile i, k-step s) unit, committed alone: unit u's A is built while unit u - 1 runs, after a wait
  // for unit u - 2 (whose registers it takes). 8 A registers live: with 128 accumulators this fits under WG1's
  // 168-register limit, which ptxas's WGMMA pipeline check goes by (pipelined whole tiles, 16 A registers live, do
  // not: ptxas then serialises every WGMMA of the kernel, C7512)
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int i = u >> 1, s = u & 1;
    if (u >= 2) asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    mla_vt_frags(a[u & 1], base, i, s);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    mla_wgmma_e4m3_rs_64x64x32(acc + 32 * i, a[u & 1], desc + 2 * s);  // k-step s: 32 bytes on in P8's rows
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int i = 0; i < 4; ++i) mla_acc32_fence(acc + 32 * i);
}
