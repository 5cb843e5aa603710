// Is the split kernel's merge-ticket hand-off clean under compute-sanitizer (racecheck, synccheck)? A stand-alone
// model of it (mla_decode_ws.py: mla_merge_ticket / mla_merge_done / mla_merge_wait): 384 threads, warpgroups 0 and 1
// are consumers, 2 the producer; pairs of programs share a counter, so one takes ticket 0 and the other ticket 1 and
// waits. Each variant launches once and checks its result; run it plain and under the sanitizer tools.
//   nvcc -O2 -gencode arch=compute_90a,code=sm_90a -lineinfo -o racecheck_ticket scripts/racecheck_ticket.cu
// Variants: 0 all 256 consumers reach the barriers from one code site; 1 warpgroups 0 and 1 from their own sites
// (as the kernel is laid out); 2 = 1 plus setmaxnreg per role; 3 = 2 with two segments per program (two slots);
// 4 = 3 with the ticket read once per warp and shuffled; 5 = 3 with `barrier.sync.aligned` (what `bar.sync` is);
// 6 = 3 with the non-aligned `barrier.sync` (legal from different code sites); 7 = 6 with the ticket published by a
// one-arrival mbarrier per slot (the kernel since session 18).
#include <cstdio>
#include <cuda_runtime.h>

template <int kVariant>
__device__ __forceinline__ void consumers_sync() {
  if (kVariant == 5) asm volatile("barrier.sync.aligned 13, 256;" ::: "memory");
  else if (kVariant >= 6) asm volatile("barrier.sync 13, 256;" ::: "memory");
  else asm volatile("bar.sync 13, 256;" ::: "memory");
}

template <int kVariant>
__device__ __forceinline__ int ticket(int* counts, int index, int* slots, int slot, unsigned long long* ready) {
  volatile int* t = slots + slot;
  if (kVariant == 7) {
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(ready + slot));
    if (threadIdx.x == 0) {
      *t = atomicAdd(counts + index, 1);
      asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
    }
    asm volatile("{\n.reg .pred done;\nwait:\n"
                 "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], 0;\n"
                 "@!done bra wait;\n}" :: "r"(bar) : "memory");
    return *t;
  }
  if (threadIdx.x == 0) *t = atomicAdd(counts + index, 1);
  consumers_sync<kVariant>();
  if (kVariant == 4) {  // one read per warp, broadcast by shuffle
    int v = (threadIdx.x % 32 == 0) ? *t : 0;
    return __shfl_sync(0xffffffffu, v, 0);
  }
  return *t;
}

template <int kVariant>
__device__ __forceinline__ void done(int* counts, int index) {
  __threadfence();
  consumers_sync<kVariant>();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(counts + index), "r"(1 << 16) : "memory");
}

template <int kVariant>
__device__ __forceinline__ void wait(int* counts, int index) {
  if (threadIdx.x == 0) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counts + index) : "memory");
    } while (seen != ((1 << 16) | 2));
    *reinterpret_cast<volatile int*>(counts + index) = 0;
  }
  consumers_sync<kVariant>();
  __threadfence();
}

// One consumer's segment end: take the ticket; the second waits; the first publishes. result[program] counts the
// tickets seen (each consumer thread adds its ticket + 1 to a per-thread sum, checked on the host).
template <int kVariant>
__device__ __forceinline__ int segment_end(int* counts, int index, int* slots, int slot, unsigned long long* ready) {
  int t = ticket<kVariant>(counts, index, slots, slot, ready);
  if ((t & 0xffff) == 1) wait<kVariant>(counts, index);
  else done<kVariant>(counts, index);
  return (t & 0xffff) + 1;
}

template <int kVariant>
__global__ void __launch_bounds__(384, 1) handoff(int* counts, int* result) {
  __shared__ int slots[2];
  __shared__ __align__(8) unsigned long long ready[2];  // variant 7: one-arrival mbarriers, one per slot
  if (kVariant == 7 && threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(ready + i))));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int segments = kVariant >= 3 ? 2 : 1;
  int sum = 0;
  if (kVariant == 0) {
    if (threadIdx.x < 256)
      for (int s = 0; s < segments; ++s) sum += segment_end<kVariant>(counts, blockIdx.x / 2 + s * 1024, slots, s, ready);
  } else if (threadIdx.x < 128) {
    if (kVariant >= 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    for (int s = 0; s < segments; ++s) sum += segment_end<kVariant>(counts, blockIdx.x / 2 + s * 1024, slots, s, ready);
  } else if (threadIdx.x < 256) {
    if (kVariant >= 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 240;");
    for (int s = 0; s < segments; ++s) sum += 1000 * segment_end<kVariant>(counts, blockIdx.x / 2 + s * 1024, slots, s, ready);
  } else {
    if (kVariant >= 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;");
  }
  if (threadIdx.x < 256) atomicAdd(result + blockIdx.x, sum);
}

template <int kVariant>
int run(int* counts, int* result, int programs) {
  cudaMemset(counts, 0, 2048 * sizeof(int));
  cudaMemset(result, 0, programs * sizeof(int));
  handoff<kVariant><<<programs, 384>>>(counts, result);
  if (cudaDeviceSynchronize() != cudaSuccess) { printf("variant %d: launch failed\n", kVariant); return 1; }
  int host[256];
  cudaMemcpy(host, result, programs * sizeof(int), cudaMemcpyDeviceToHost);
  // per pair of programs and segment, tickets 0 and 1: 128 threads of each warpgroup saw 1 or 2
  long total = 0;
  for (int p = 0; p < programs; ++p) total += host[p];
  const int segments = kVariant >= 3 ? 2 : 1;
  const long want = (kVariant == 0 ? 256L * 3 / 2 : 128L * 3 / 2 * 1001) * programs * segments;
  printf("variant %d: %s (sum %ld, want %ld)\n", kVariant, total == want ? "ok" : "WRONG", total, want);
  fflush(stdout);
  return total != want;
}

int main() {
  int *counts, *result;
  cudaMalloc(&counts, 2048 * sizeof(int));
  cudaMalloc(&result, 256 * sizeof(int));
  const int programs = 64;  // resident at once on an H100: a waiting program's partner holds its ticket
  int bad = run<0>(counts, result, programs) + run<1>(counts, result, programs) + run<2>(counts, result, programs) +
            run<3>(counts, result, programs) + run<4>(counts, result, programs) + run<5>(counts, result, programs) +
            run<6>(counts, result, programs) + run<7>(counts, result, programs);
  return bad != 0;
}
