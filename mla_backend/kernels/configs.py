"""Per-architecture tile configurations for the TileLang MLA decode kernels."""

from __future__ import annotations

from dataclasses import dataclass, replace

# What the kernels accept (the op validates against these before launching), re-exported for older imports
from ..constants import (MAX_HEADS, MAX_PARTS, MAX_Q_LEN, SUPPORTED_DTYPES, SUPPORTED_KV_DTYPES,  # noqa: F401
                         SUPPORTED_PAGE_SIZES)


@dataclass(frozen=True)
class KernelConfig:
    block_rows: int  # query rows (q_len x heads) per tile; WGMMA needs 64 on sm90
    block_n: int  # KV tokens per pipeline step
    threads: int
    num_stages: int
    # the split kernel: "tws" (kernels/sm90/: warp-specialised, its consumers transposed where h x q_len <= 16, "ws"
    # otherwise) or "pipelined" (kernels/portable.py)
    kernel: str
    # sm90: the split and combine kernels wait for the stream's previous kernel (griddepcontrol.wait) before they read
    # anything. TileLang launches every cluster kernel (and every kernel that waits) with programmatic stream
    # serialisation allowed, so without the wait a cluster split kernel could start on free SMs and read q or the cache
    # before a predecessor that triggers its dependents early (CUTLASS, FlashInfer built with PDL) has written them.
    # The split does not trigger its combine early: that was 1.5-3 us slower at b=1 (benchmarks/RESULTS.md).
    pdl: bool = False
    # diagnostics (scripts/trace_blocks.py), never in a served kernel: >= 0 records clock64 at each role's steps for
    # the first 64 blocks of this part (row block 0; ws consumers and the 16-bit producer) into the plan's unused
    # last partial slot
    trace_part: int = -1
    # sm90 with an fp8 cache where the ws kernel runs (h x q_len > 16): q quantised per (token, head) row to e4m3, S
    # and P V on e4m3 WGMMA (kernels/sm90/fp8c.py); False converts the cache to fp16 and keeps q in 16 bits
    fp8_compute: bool = False


# Hopper (kernels/sm90/): 2 consumer warpgroups + 1 producer (FlashMLA-style), 64-token blocks, 2 buffers; the
# consumers transposed (S^T = K Q^T) where h x q_len <= 16. Whole blocks of a 16-bit cache arrive by TMA, shared by
# the two CTAs of a cluster where the row blocks pair up.
SM90 = KernelConfig(block_rows=64, block_n=64, threads=384, num_stages=2, kernel="tws", pdl=True)
# MI300X (kernels/portable.py): 64 KB of LDS, so one stage and 16-row tiles (MFMA has no WGMMA 64-row minimum);
# 128 threads keep the 512-wide fp32 accumulator in registers. 58368 B of LDS (TileLang 0.1.9's count; 57344 B in
# 0.1.11's code objects) for fp16/bf16 and float8_e4m3fnuz caches alike: an fp8 cache is converted into the 16-bit
# KV tiles as it is loaded, with no fp8 staging tile.
GFX942 = KernelConfig(block_rows=16, block_n=32, threads=128, num_stages=1, kernel="pipelined")

CONFIGS = {"sm90": SM90, "gfx942": GFX942}

SM90_FP8_COMPUTE = replace(SM90, fp8_compute=True)
# Rows (heads x q_len) from which an fp8 cache may run on e4m3 tensor cores: the ws kernel's (the transposed tws kernel
# of up to 16 rows is memory-bound, and its fp8 path already moves half the bytes of the 16-bit one).
FP8_COMPUTE_MIN_ROWS = 17


def config_for(arch: str, fp8_compute: bool = False) -> KernelConfig:
    """The tile configuration the kernels of ``arch`` ("sm90" or "gfx942") are built and planned with; with
    ``fp8_compute`` (sm90, see ``fp8_compute_applies``) the e4m3-compute one."""
    if fp8_compute:
        if arch != "sm90":
            raise ValueError(f"fp8 compute is an sm90 kernel, not {arch}'s")
        return SM90_FP8_COMPUTE
    return CONFIGS[arch]


def fp8_compute_applies(arch: str, num_heads: int, q_len: int | None, fp8_cache: bool) -> bool:
    """Whether ``fp8_compute=True`` changes the kernel of this shape: an fp8 cache on sm90 with at least
    ``FP8_COMPUTE_MIN_ROWS`` rows; everywhere else the cache is converted to 16 bits and q kept as it is."""
    return fp8_cache and arch == "sm90" and q_len is not None and num_heads * q_len >= FP8_COMPUTE_MIN_ROWS


def compat_pass_configs() -> dict:
    """TileLang pass configs every kernel is compiled with (runtime.py) and lowered with (tests), keeping newer
    TileLangs' lowering of these kernels as 0.1.9's. Only keys the installed TileLang knows (others reject unknown).

    ``tl.if_stmt_binding_inline_replayable_binds`` (TileLang >= 0.1.11, default on): IfStmtBinding splits a guarded
    body such as a request segment (``if blk_hi > blk_lo:``) into separately guarded statements and substitutes
    its scalar binds (``tok0 = qo_indptr[req]``, ``kv_len = kv_lens[req]``, ...) at every use. The ws kernel's
    consumer warpgroups then spill under their setmaxnreg budgets (0.1.12: 300 B, 0.1.15: 280 B; 0.1.9: none).

    ``tl.disable_buffer_init_check`` (TileLang >= 0.1.15, a check only, no effect on the code): the check reads each
    warpgroup's code alone, so the shared buffers one warpgroup writes and another reads after a barrier
    (``p_shared``, ``alpha_slots``) look read before written, and every compile logged three false warnings.
    """
    import tilelang

    keys = tilelang.PassConfigKey
    settings = {"TL_IF_STMT_BINDING_INLINE_REPLAYABLE_BINDS": False, "TL_DISABLE_BUFFER_INIT_CHECK": True}
    configs = {}
    for name, value in settings.items():
        key = getattr(keys, name, None)
        if key is not None:
            configs[key.value if hasattr(key, "value") else key] = value
    return configs


def kernel_launch(*blocks, threads: int, prelude: str | None = None, cluster_dims: tuple | None = None):
    """``T.Kernel(*blocks, threads=, prelude=, cluster_dims=)`` under every TileLang the package admits, for use as
    ``with kernel_launch(...) as (bx, by):`` inside a prim_func.

    TileLang 0.1.9, 0.1.11 and >= 0.1.13 take ``cluster_dims`` in ``T.Kernel`` (this calls it as written, so their
    kernels are unchanged); 0.1.12's ``T.Kernel`` has no such argument and launches a thread-block cluster through
    ``T.ClusterKernel(*blocks, cluster_dims=..., ...)`` instead (the same ``cluster_dims`` launch attribute). Without
    ``cluster_dims`` it is a plain ``T.Kernel`` everywhere.
    """
    import inspect

    import tilelang.language as T

    if cluster_dims is None:
        return T.Kernel(*blocks, threads=threads, prelude=prelude)
    if "cluster_dims" in inspect.signature(T.Kernel).parameters:
        return T.Kernel(*blocks, threads=threads, prelude=prelude, cluster_dims=cluster_dims)
    return T.ClusterKernel(*blocks, cluster_dims=cluster_dims, threads=threads, prelude=prelude)


def target_for_arch(arch: str) -> dict:
    """TVM target in dict form: TileLang >= 0.1.11 (SGLang's pin) rejects the "cuda -arch=..." string form."""
    return {"sm90": {"kind": "cuda", "arch": "sm_90a"}, "gfx942": {"kind": "hip", "mcpu": "gfx942"}}[arch]
