"""The Hopper (sm_90a) MLA decode: warp-specialised (FlashMLA-style), same contract as ``kernels/portable.py``.

Same prim_func name, argument list and order as :func:`mla_backend.kernels.portable.build_decode_kernel`, same plan
semantics (parts over the flattened (request, block)
list, ``part_start`` / ``req_parts``, direct write when a request lies in one part, partial slot ``part + req``,
log2 partial LSE, natural-log final LSE, zeros / -inf for rows that see nothing, causal rule
``pos < kv_len - q_len + row // num_heads + 1``, fp8 scale folded into S and O, clamped tail reads).
The only difference visible to the host is the KV block size: 64 tokens, so the split planner must
be built with ``block_n=configs.SM90.block_n`` (64). The combine kernels of ``combine.py`` are shared (they do not
depend on the block size).

Modules: ``protocol`` (budgets, barrier parities, the CUDA prelude ``prelude.cuh``), ``producer`` (Q and KV into
shared memory), ``consumers`` (S, mask, P V), ``epilogue`` (normalise, write), ``roles`` (each warpgroup's
request walk), ``kernel`` (one variant's choices and the prim_func); ``fp8c`` and ``fp8c_roles`` (with its device
helpers ``fp8c.cuh``): the ws kernel for an fp8 cache with ``KernelConfig.fp8_compute``, S and P V on e4m3 WGMMA.

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
    dynamic                            230144   (TileLang's dyn_shared_memory_buf)
    mbarriers  10 x 8, static            1024   (nvcc pads static shared to the 1 KiB alignment of the dynamic buffer)
    total                              231168   (1280 B to spare)

There is no room for a separate fp8 staging tile (64 x 576 x 1 = 36864 B), so for an fp8 cache the
producer loads with plain loads and converts in registers; the per-tensor ``k_scale`` is applied to S
(through the softmax scale) and to O, as in ``portable.py``. With an fp8 cache the ws kernel computes in
fp16 whatever q's dtype: e4m3 -> fp16 is one hardware instruction per pair (``cvt.rn.f16x2.e4m3x2``;
bf16 would take five), exact, and a bf16 q becomes fp16 x 2^-8 in shared memory (exact unless below
2^-6, where the absolute error stays under 2^-17; overflow only above 2^24), the 2^8 undone in the
softmax scale; P in fp16 is finer than in bf16. The output keeps q's dtype. The producer streams rows:
it holds two rows per thread and keeps one row's 9 loads in flight while converting the other (the
next block's first row during this block's second), issues a block's loads before waiting for its
buffer, and first asks L2 for the rows of the block two ahead (``prefetch.global.L2``). The tws producer
(whose consumers leave it 240 registers) holds 4 rows: the next block's two load while this block's two
convert, issued after this block's first conversion (one scoreboard counts all of a thread's loads), and
asks L2 for nothing past a segment's first two blocks (docs/kernels.md). With TWS_FP8_PRODUCERS = 2 (the
default) the tws fp8 kernel has 512 threads: two producer warpgroups take blocks in turn, each converting
from one row set and then issuing its next block's loads, which so have two blocks' time to land.

Synchronisation (mbarriers; arrive counts in threads). ``g`` is the block's index inside the part
(``flat block - part_start[part]``: a running counter that carries across requests, so the
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

A request the plan cuts into parts leaves an fp32 partial and its LSE per part; the combine kernel (``combine.py``)
merges them, and writes the empty requests.

docs/kernels.md walks through the phases (request boundary, odd block count, empty segment, a part
that touches several requests); tests/test_lowering_ws_protocol.py simulates them for random plans.
"""

from .kernel import build_decode_kernel, variant_spec
from .protocol import (HALF, TRACE_BLOCKS, TRACE_HEAD, TRACE_ROLES, TRACE_STEPS, TWS_COLS, kernel_threads,
                       register_budget, smem_budget)

__all__ = ["HALF", "TRACE_BLOCKS", "TRACE_HEAD", "TRACE_ROLES", "TRACE_STEPS", "TWS_COLS", "build_decode_kernel",
           "kernel_threads", "register_budget", "smem_budget", "variant_spec"]
