"""Per-architecture tile configurations for the TileLang MLA decode kernels."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    block_rows: int  # query rows (q_len x heads) per tile; WGMMA needs 64 on sm90
    block_n: int  # KV tokens per pipeline step
    threads: int
    num_stages: int
    kernel: str = "pipelined"  # kernel source: "pipelined" (mla_decode.py), "ws", "seesaw" or "tws" (mla_decode_ws.py)
    tma_kv: bool = False  # ws / tws / seesaw, 16-bit cache, page size a multiple of block_n: whole blocks by TMA
    rs_pv: bool = False  # ws / tws beyond 16 rows: WG0's P V from P in registers, P and alpha stored without a barrier
    # ws / tws: a request split into two parts is merged by the second of its programs to finish (in its epilogue,
    # from the other's partial) instead of by the combine kernel
    merge_pairs: bool = False
    # ws / tws, 16-bit cache: the producer reads a block's page ids before it waits for the block's buffer (seesaw's
    # producer always does)
    pages_ahead: bool = False
    # rs_pv: WG0 hands P to WG1 and issues its P V before it forms its row sums (per thread), which it does while the
    # GEMMs run
    pv_first: bool = False
    # ws / tws beyond 16 rows, 16-bit cache: one k_ready barrier per tile of a KV buffer (S starts on the first tile
    # that lands, WG1 waits for its V half only)
    tile_ready: bool = False
    # ws WG0 (beyond 16 rows): the row max of S by a 4-level tree per thread (mla_row_max2, same bits) instead of
    # TileLang's 16-deep chain
    tree_max: bool = False
    # ws WG0 (rs_pv): FlashAttention-3's order after P is made: P's stores for WG1, then WG0's own P V issued, and only
    # then the fence and p_ready (the fence waits for the stores; before, WG0's P V waited for it)
    pv_early: bool = False
    # ws WG0: O's rescale right after alpha, unconditional, so ptxas interleaves its 128 multiplies with P's exp2s
    # (the MUFU pipe bounds those); before, after P's hand-over and skipped where alpha is 1
    rescale_early: bool = False
    # ws WG0 (tree_max): S's row max on the raw scores (times the positive scale) and P = exp2(S * scale - m) as one
    # FFMA per element, instead of a multiply of S by the scale before the max
    scale_in_exp: bool = False
    # ws WG0 (rs_pv): the wait for WG1 to be done with the previous P right after S, not before P's stores, so no
    # branch splits the softmax for ptxas's scheduler
    pfree_early: bool = False
    # ws with tma_kv and tile_ready, an even number of row blocks: the row-block CTAs of a part run as clusters of two
    # that share each whole block by TMA multicast (each CTA issues half of it for both)
    cluster_kv: bool = False
    # cluster_kv: the rope box multicast as well (by rank g % 2 for block g), not loaded by each CTA
    cluster_rope: bool = False
    # sm90: the split and combine kernels wait for the stream's previous kernel (griddepcontrol.wait) before they read
    # anything. TileLang launches every cluster kernel (and every kernel that waits) with programmatic stream
    # serialisation allowed, so without the wait a cluster split kernel could start on free SMs and read q or the cache
    # before a predecessor that triggers its dependents early (CUTLASS, FlashInfer built with PDL) has written them.
    # The split does not trigger its combine early: that was 1.5-3 us slower at b=1 (session 28; benchmarks/RESULTS.md)
    pdl: bool = False
    # diagnostics (scripts/trace_blocks.py), never in a served kernel: >= 0 records clock64 at each role's steps for
    # the first 64 blocks of this part (row block 0; ws consumers and the 16-bit producer) into the plan's unused
    # last partial slot
    trace_part: int = -1


# Hopper: 2 warpgroups split the 512-wide output (FullCol), 227 KB of shared memory per block. Q (72 KB)
# plus 2 stages of 64-token KV (144 KB), P and TileLang's reduction scratch come to 228 KB: 1 KB too many,
# so 32-token blocks with 3 stages (108 KB, more bytes in flight).
SM90 = KernelConfig(block_rows=64, block_n=32, threads=256, num_stages=3, pdl=True)
# Hopper, warp-specialised (FlashMLA-style): 2 consumer warpgroups + 1 producer, 64-token blocks, 2 buffers.
SM90_WS = KernelConfig(block_rows=64, block_n=64, threads=384, num_stages=2, kernel="ws", tma_kv=True, rs_pv=True,
                     merge_pairs=True, pages_ahead=True, pv_first=True, tile_ready=True, tree_max=True,
                     pv_early=True, rescale_early=True, scale_in_exp=True,
                     pfree_early=True, cluster_kv=True, cluster_rope=True, pdl=True)
# Hopper, warp-specialised "seesaw" (FlashMLA's schedule): both consumers compute S for alternate blocks
# and each keeps half of O, so S, softmax and P @ V of the two warpgroups overlap.
SM90_SEESAW = KernelConfig(block_rows=64, block_n=64, threads=384, num_stages=2, kernel="seesaw", tma_kv=True,
                           pdl=True)
# Hopper, warp-specialised with transposed consumers where h x q_len <= 16 (S^T = K Q^T: tokens are WGMMA's M,
# so 16 rows are not padded to 64), the "ws" kernel for other shapes. The default since session 7: on the H100
# its fp8 producer (a whole block of loads in flight) makes the e4m3 cache 1.68x faster than bf16 (ws: 1.37x;
# 1.79x since session 10, 1.84x with its two producer warpgroups since session 11), bf16 level with ws; 37/37 GPU tests under TileLang 0.1.9 and 0.1.11 (session 11; benchmarks/RESULTS.md).
# Since session 14 whole blocks of a 16-bit cache with page size a multiple of 64 arrive by TMA (tma_kv): 2.5-3.7%
# faster at h=128 on the H100, level elsewhere (benchmarks/RESULTS.md); MLA_BACKEND_SM90_TMA=0 keeps cp.async.
# Since session 15 the ws consumers' WG0 multiplies P V from P in registers (rs_pv): 6% faster at h=128 s_q=2 in the
# A/B, 1.13 -> 1.08 of the faster anchor side by side; MLA_BACKEND_SM90_RSPV=0 keeps P V from shared memory.
# Since session 16 a request split into two parts is merged in the split kernel (merge_pairs; MLA_BACKEND_SM90_MERGE=0
# leaves it to the combine kernel). Since session 17 the producer reads a block's page ids before it waits for the
# block's buffer (pages_ahead: 3.5-3.8% at h=128 in the A/B, MLA_BACKEND_SM90_PAGES=0 reads them after it) and WG0 adds
# its row sums while its P V runs (pv_first: 1.7-2.6% at h=128 s_q=2, MLA_BACKEND_SM90_PVFIRST=0).
# Since session 20 the ws consumers' KV tiles land on their own k_ready each (tile_ready: 0.4-2% at h=128, level
# elsewhere; MLA_BACKEND_SM90_TILES=0 keeps one per buffer). Since session 22 WG0 takes S's row max by a tree (tree_max,
# same bits: 0.5-3% at h=128 on an H200, level on an H100; MLA_BACKEND_SM90_TREEMAX=0 keeps TileLang's chain).
# Since session 24 the row-block CTAs of a part run as clusters of two that share each whole block by TMA multicast
# (cluster_kv: 6-9% faster at h=128 and h=64 s_q=2 in the A/B; MLA_BACKEND_SM90_CLUSTER=0 loads per CTA); since
# session 25 the rope box too (cluster_rope: ~1% there, side by side and in the A/B; MLA_BACKEND_SM90_CLUSTER_ROPE=0).
SM90_TWS = KernelConfig(block_rows=64, block_n=64, threads=384, num_stages=2, kernel="tws", tma_kv=True,
                        rs_pv=True, merge_pairs=True, pages_ahead=True, pv_first=True,
                        tile_ready=True, tree_max=True, pv_early=True, rescale_early=True, scale_in_exp=True,
                        pfree_early=True, cluster_kv=True, cluster_rope=True, pdl=True)
# MI300X: 64 KB of LDS, so one stage and 16-row tiles (MFMA has no WGMMA 64-row minimum); 128 threads
# keep the 512-wide fp32 accumulator in registers. 58368 B of LDS for fp16/bf16 caches.
GFX942 = KernelConfig(block_rows=16, block_n=32, threads=128, num_stages=1)

CONFIGS = {"sm90": SM90, "gfx942": GFX942}
SM90_KERNELS = {"pipelined": SM90, "ws": SM90_WS, "seesaw": SM90_SEESAW, "tws": SM90_TWS}
# MLA_BACKEND_SM90_KERNEL picks the Hopper kernel (benchmarks/RESULTS.md has them measured).
SM90_KERNEL_ENV = "MLA_BACKEND_SM90_KERNEL"
DEFAULT_SM90_KERNEL = "tws"
SM90_TMA_ENV = "MLA_BACKEND_SM90_TMA"  # "0": KV blocks by cp.async only (the kernels before session 14)
SM90_RSPV_ENV = "MLA_BACKEND_SM90_RSPV"  # "0": WG0's P V from P in shared memory (the kernels before session 15)
SM90_MERGE_ENV = "MLA_BACKEND_SM90_MERGE"  # "0": the combine kernel merges every split request (before session 16)
SM90_PAGES_ENV = "MLA_BACKEND_SM90_PAGES"  # "0": page ids read after the wait for the buffer (before session 17)
SM90_PVFIRST_ENV = "MLA_BACKEND_SM90_PVFIRST"  # "0": WG0's row sums before P's copy and its P V (before session 17)
SM90_TILES_ENV = "MLA_BACKEND_SM90_TILES"  # "0": one k_ready per KV buffer (before session 20)
SM90_TREEMAX_ENV = "MLA_BACKEND_SM90_TREEMAX"  # "0": TileLang's row max (a chain) in WG0 (before session 22)
SM90_PVEARLY_ENV = "MLA_BACKEND_SM90_PVEARLY"  # "0": WG0's P V issued after the fence and p_ready (before session 23)
SM90_RESCALE_ENV = "MLA_BACKEND_SM90_RESCALE"  # "0": WG0's O rescale after P's hand-over, skipped at alpha 1 (before 23)
SM90_FFMA_ENV = "MLA_BACKEND_SM90_FFMA"  # "0": S times the scale before the row max (before session 23)
SM90_PFREE_ENV = "MLA_BACKEND_SM90_PFREE"  # "0": WG0 waits for WG1's release of P just before P's stores (before 23)
SM90_CLUSTER_ENV = "MLA_BACKEND_SM90_CLUSTER"  # "0": each row-block CTA loads every block itself (before session 24)
SM90_CLUSTER_ROPE_ENV = "MLA_BACKEND_SM90_CLUSTER_ROPE"  # "0": each CTA of a pair loads its rope box (before 25)
SM90_PDL_ENV = "MLA_BACKEND_SM90_PDL"  # "0": the kernels do not wait for the previous kernel (griddepcontrol; before 28)


# os.environ.get encodes its key on every call (~0.8 µs on the H100 machine's CPU), and an eager decode call read
# ~30 settings (session 27: ~25 µs of its ~90 µs host time). The op's hot path looks them up in the environment's own
# bytes dict instead: CPython's os.environ._data, which os.environ's setters (and so mock.patch.dict and pytest's
# monkeypatch) keep current, exactly what os.environ.get reads. Elsewhere (no such dict) it falls back to os.environ.
_ENV_DATA = getattr(os.environ, "_data", None)
_FAST_ENV = isinstance(_ENV_DATA, dict) and os.name == "posix"
_ENV_KEYS: dict = {}  # a name -> its bytes key; a tuple of names -> theirs


def env_get(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)`` without the per-call key encoding (POSIX CPython)."""
    if not _FAST_ENV:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = _ENV_DATA.get(key)
    return default if value is None else os.fsdecode(value)


def env_fingerprint(names: tuple[str, ...]) -> tuple:
    """The raw values of the settings ``names`` (bytes, or str where env_get falls back; None when unset): equal
    tuples mean equal settings, one C-level lookup each."""
    if not _FAST_ENV:
        return tuple(map(os.environ.get, names))
    keys = _ENV_KEYS.get(names)
    if keys is None:
        keys = _ENV_KEYS[names] = tuple(map(os.fsencode, names))
    return tuple(map(_ENV_DATA.get, keys))


def env_switch(env: str) -> bool:
    """An on/off setting: unset or "1" is on, "0" off; any other value is refused, naming the variable."""
    value = env_get(env, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{env}={value!r} is not supported; expected 0 or 1")
    return value == "1"


# The on/off switches of the sm90 kernels and the config field each turns off.
SM90_SWITCHES = ((SM90_TMA_ENV, "tma_kv"), (SM90_RSPV_ENV, "rs_pv"), (SM90_MERGE_ENV, "merge_pairs"),
                 (SM90_PAGES_ENV, "pages_ahead"), (SM90_PVFIRST_ENV, "pv_first"), (SM90_TILES_ENV, "tile_ready"),
                 (SM90_TREEMAX_ENV, "tree_max"), (SM90_PVEARLY_ENV, "pv_early"), (SM90_RESCALE_ENV, "rescale_early"),
                 (SM90_FFMA_ENV, "scale_in_exp"), (SM90_PFREE_ENV, "pfree_early"), (SM90_CLUSTER_ENV, "cluster_kv"),
                 (SM90_CLUSTER_ROPE_ENV, "cluster_rope"), (SM90_PDL_ENV, "pdl"))
_SM90_SETTINGS = (SM90_KERNEL_ENV,) + tuple(env for env, _ in SM90_SWITCHES)
# config_for's results by the raw values of its settings (valid ones only: a refused value raises on every call)
_SM90_CONFIGS: dict[tuple, KernelConfig] = {}


def config_for(arch: str) -> KernelConfig:
    """The tile configuration the kernels of ``arch`` ("sm90" or "gfx942") are built and planned with (the sm90
    settings are read on every call, so a changed environment takes effect at the next call)."""
    if arch != "sm90":
        return CONFIGS[arch]
    raw = env_fingerprint(_SM90_SETTINGS)
    cfg = _SM90_CONFIGS.get(raw)
    if cfg is not None:
        return cfg
    name = env_get(SM90_KERNEL_ENV) or DEFAULT_SM90_KERNEL
    if name not in SM90_KERNELS:
        raise ValueError(f"{SM90_KERNEL_ENV}={name!r} is not supported; expected one of {tuple(SM90_KERNELS)}")
    cfg = SM90_KERNELS[name]
    for env, field in SM90_SWITCHES:
        if not env_switch(env) and getattr(cfg, field):
            cfg = dataclasses.replace(cfg, **{field: False})
    _SM90_CONFIGS[raw] = cfg
    return cfg


def merged_parts(cfg: KernelConfig) -> int:
    """Parts of a request the split kernel of ``cfg`` merges itself: 2 (``merge_pairs``) or 0; the combine takes the
    other split requests (the seesaw and pipelined kernels merge none)."""
    return 2 if cfg.merge_pairs and cfg.kernel in ("ws", "tws") else 0


# What the kernels accept (the op validates against these before launching).
SUPPORTED_DTYPES = ("float16", "bfloat16")
SUPPORTED_KV_DTYPES = ("float16", "bfloat16", "float8_e4m3fn")
SUPPORTED_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_HEADS = 128
MAX_Q_LEN = 4
# Most split-KV parts a plan may have: the combine kernel keeps one LSE per part of a request in shared memory.
MAX_PARTS = 256


def compat_pass_configs() -> dict:
    """TileLang pass configs every kernel is compiled with (runtime.py) and lowered with (tests), keeping newer
    TileLangs' lowering of these kernels as 0.1.9's. Only keys the installed TileLang knows (others reject unknown).

    ``tl.if_stmt_binding_inline_replayable_binds`` (TileLang >= 0.1.11, default on): IfStmtBinding splits a guarded
    body such as a request segment (``if blk_hi > blk_lo:``) into separately guarded statements and substitutes
    its scalar binds (``tok0 = qo_indptr[req]``, ``kv_len = kv_lens[req]``, ...) at every use. The ws kernel's
    consumer warpgroups then spill under their setmaxnreg budgets (0.1.12: 300 B, 0.1.15: 280 B; 0.1.9: none).
    """
    import tilelang

    key = getattr(tilelang.PassConfigKey, "TL_IF_STMT_BINDING_INLINE_REPLAYABLE_BINDS", None)
    return {} if key is None else {key.value if hasattr(key, "value") else key: False}


def target_for_arch(arch: str) -> dict:
    """TVM target in dict form: TileLang >= 0.1.11 (SGLang's pin) rejects the "cuda -arch=..." string form."""
    return {"sm90": {"kind": "cuda", "arch": "sm_90a"}, "gfx942": {"kind": "hip", "mcpu": "gfx942"}}[arch]
