"""MLA paged-decode benchmark: our TileLang op vs vLLM 0.26's FlashMLA, FA3-MLA and Triton-MLA and SGLang's FlashMLA
build (``flashmla-sgl``, sgl-kernel), on one GPU.

``mla-backend bench [--quick | --grid G] [--filter b=128,h=16] [--impls ours,flashmla,fa3,triton,flashmla-sgl]
[--fp8] [--graphs] [--check] [--out-dir DIR] [--dry-run]``; also ``python -m mla_backend.bench``.
``mla-backend bench --host``: the host time of one call instead (``bench_host.py``).

Timing: median over many runs, with a 256 MB buffer zeroed (L2 flush) before every run and CUDA events
around the call only. A spin kernel after the flush keeps the host launch cost out of the window
(it is reported separately as host_us). ``--graphs`` times CUDA-graph replays instead. ``ours`` is the
whole ``mla_decode`` call (split and combine kernels). Its split plan is computed once per config, as an
engine plans once per step for all layers, and the planner is timed on its own (``plan_us``). The
anchors get their per-step metadata in the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import statistics
import sys
import time

import torch

from .bench_report import environment, save, table
from .cli import nothing_ran
from .constants import HEAD_DIM as HEAD
from .constants import KV_LORA_RANK as LATENT
from .constants import ROPE_DIM as ROPE
from .kernels.configs import FP8_COMPUTE_MIN_ROWS, fp8_compute_applies

QO = HEAD + LATENT  # q (576) + out (512) elements per (token, head)
SOFTMAX_SCALE = 192 ** -0.5
K_SCALE = 0.5  # non-unit fp8 dequantisation scale
MAX_SQ = 2  # ragged lengths are shared by both s_q classes, so they are clamped at the largest s_q
# FlashMLA as SGLang's sgl-kernel builds it (a newer release than vLLM 0.26's; SGLang's flashmla backend)
FLASHMLA_SGL = "flashmla-sgl"
IMPLS = ("ours", "flashmla", "fa3", "triton", FLASHMLA_SGL)
BEST_ANCHORS = ("flashmla", FLASHMLA_SGL, "fa3")  # ours / best: our time over the fastest of these
# ours-fp8c: ours with an fp8 cache and fp8_compute=True (q quantised per (token, head) row, e4m3 tensor cores)
FP8_COMPUTE = "ours-fp8c"
# flashmla-fp8 times FlashMLA's fp8 kernel on a q quantised ahead; flashmla-fp8q adds what vLLM runs before it in
# every layer (MLAAttention's decode: q_nope and q_pe concatenated and quantised per tensor, one compiled kernel),
# the work ours-fp8c does inside its kernel
FLASHMLA_FP8_Q = "flashmla-fp8q"
FP8_IMPLS = {"ours": ("ours-fp8", FP8_COMPUTE), "flashmla": ("flashmla-fp8", FLASHMLA_FP8_Q), "triton": ("triton-fp8",)}
ORDER = ("ours", "flashmla", FLASHMLA_SGL, "fa3", "triton", "ours-fp8", FP8_COMPUTE, "flashmla-fp8", FLASHMLA_FP8_Q,
         "triton-fp8")
FP8_MAX = 448.0  # e4m3's largest finite value
# The served grid's spread of lengths: serve-bench's 4k decode cells as SGLang's DP-attention GPUs held them
# (4096-4300 tokens, RESULTS section 11)
SERVED_SPREAD = 205


def fp8_kv(name: str) -> bool:
    """Whether impl ``name`` reads the fp8 cache."""
    return name.endswith("-fp8") or name in (FP8_COMPUTE, FLASHMLA_FP8_Q)


def base_impl(name: str) -> str:
    """The implementation behind ``name``: "ours", "flashmla", "fa3" or "triton"."""
    return "ours" if name == FP8_COMPUTE else "flashmla" if name == FLASHMLA_FP8_Q else name.removesuffix("-fp8")


def tolerance(name: str) -> float:
    """max|a - b| / max|b| above which a warning is printed (FlashMLA's fp8 path and ours-fp8c quantise q to fp8)."""
    if base_impl(name) == "flashmla" and fp8_kv(name):
        return 0.2
    return 0.1 if name == FP8_COMPUTE else 5e-2 if fp8_kv(name) else 2e-2


# ----------------------------------------------------------------------------- configs and metrics
@dataclasses.dataclass(frozen=True)
class Config:
    b: int
    s_k: int
    h: int
    s_q: int
    ragged: bool
    page: int = 64
    # grid | latency | page | mixed | served (not part of ==)
    kind: str = dataclasses.field(default="grid", compare=False)
    # > 0: the last of the b requests holds this many tokens instead (a long prompt decoding among short ones,
    # the decode batch of a served mixed load)
    long_len: int = 0
    # > 0: lengths s_k .. s_k + spread - 1 (uniform): prompts of s_k tokens prefilled at different steps, the
    # decode batch of an engine that serves b prompts of one length
    spread: int = 0

    @property
    def lens(self) -> str:
        return f"spread{self.spread}" if self.spread else "ragged" if self.ragged else "fixed"

    def label(self) -> str:
        tail = f" +1x{self.long_len}" if self.long_len else ""
        return f"b={self.b} s_k={self.s_k} h={self.h} s_q={self.s_q} {self.lens}{tail} p{self.page}"

    def kv_key(self) -> tuple:
        return (self.b, self.s_k, self.page, self.ragged, self.long_len, self.spread)


def make_configs(grid: str = "full", quick: bool = False) -> list[Config]:
    """FlashMLA's grid + latency cases + page sizes, deduplicated and grouped by KV cache (for reuse)."""
    if quick:
        cfgs = [Config(64, 4096, 16, 1, False), Config(128, 16384, 16, 1, False), Config(128, 16384, 128, 1, False),
                Config(128, 32768, 16, 1, True), Config(64, 8192, 128, 2, False), Config(128, 16384, 16, 2, True),
                Config(128, 8192, 128, 1, True), Config(64, 32768, 128, 1, False), Config(64, 16384, 16, 1, True),
                Config(1, 4096, 16, 1, False, kind="latency"), Config(16, 16384, 128, 1, False, kind="latency"),
                Config(128, 16384, 16, 1, False, 16, "page")]
    else:
        cfgs = []
        if grid in ("full", "flashmla"):
            cfgs += [Config(b, s, h, sq, r) for b in (64, 128) for s in (4096, 8192, 16384, 32768)
                     for h in (16, 32, 64, 128) for sq in (1, 2) for r in (False, True)]
        if grid in ("full", "latency"):
            cfgs += [Config(b, s, h, 1, False, kind="latency") for b in (1, 16) for s in (4096, 16384) for h in (16, 128)]
        if grid in ("full", "pages"):
            cfgs += [Config(128, 16384, h, 1, False, p, "page") for h in (16, 128) for p in (1, 16, 64)]
        if grid in ("full", "mixed"):  # 64 requests of ~1k tokens, alone and with one of 16k (a served mixed load's
            # decode batch before and after its long prompt's prefill): short segments, splits and the combine
            cfgs += [Config(b, 1024, h, sq, True, 64, "mixed", long_len) for b, long_len in ((64, 0), (65, 16384))
                     for h in (16, 128) for sq in (1, 2)]
        if grid in ("full", "served"):  # serve-bench's decode cells as a GPU sees them: 4k prompts decoding for up
            # to ~200 steps, 16 and 64 requests (batch 32 and 128 over two DP-attention GPUs), 64 and 128 heads
            cfgs += [Config(b, 4096, h, sq, True, 64, "served", spread=SERVED_SPREAD) for b in (16, 64)
                     for h in (64, 128) for sq in (1, 2)]
    unique = list(dict.fromkeys(cfgs))  # the page-64 case is the grid's own config: keep the first
    return sorted(unique, key=lambda c: (c.kv_key(), c.h, c.s_q))


_KEYS = {"b": "b", "s_k": "s_k", "sk": "s_k", "s": "s_k", "h": "h", "s_q": "s_q", "sq": "s_q", "page": "page",
         "lens": "lens", "kind": "kind", "long_len": "long_len", "spread": "spread"}
_OPS = {"=": lambda a, b: a == b, "<": lambda a, b: a < b, ">": lambda a, b: a > b, "<=": lambda a, b: a <= b,
        ">=": lambda a, b: a >= b}


def parse_filter(expr: str) -> list[tuple[str, str, list]]:
    """``"b=128,h=16|32,s_k>=8192,lens=ragged"``: a comma means and, ``|`` means any of."""
    terms = []
    for term in filter(None, (t.strip() for t in expr.split(","))):
        m = re.fullmatch(r"(\w+)\s*(<=|>=|!=|=|<|>)\s*([\w|]+)", term)
        if not m or m.group(1) not in _KEYS:
            raise ValueError(f"bad filter term {term!r}: expected KEY(=|!=|<|>|<=|>=)VALUE, KEY one of "
                             f"{', '.join(sorted(set(_KEYS)))}")
        terms.append((_KEYS[m.group(1)], m.group(2), [int(v) if v.isdigit() else v for v in m.group(3).split("|")]))
    return terms


def matches(cfg: Config, terms) -> bool:
    for key, op, vals in terms:
        v = getattr(cfg, key)
        if not (all(v != x for x in vals) if op == "!=" else any(_OPS[op](v, x) for x in vals)):
            return False
    return True


def select(cfgs: list[Config], filters: list[str] | None) -> list[Config]:
    """Keep configs matching any of the filters (each one an and of terms)."""
    parsed = [parse_filter(f) for f in filters or []]
    return [c for c in cfgs if not parsed or any(matches(c, t) for t in parsed)]


def seq_lens(cfg: Config, seed: int = 0) -> list[int]:
    """KV lengths: ``s_k`` each, or ~N(s, s/2) clamped to [2, 2s], or ``s_k`` plus up to ``spread - 1``, seeded by
    (seed, b, s_k); the last one ``long_len`` where that is set."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + cfg.b * 7919 + cfg.s_k)
    if cfg.spread:
        lens = (cfg.s_k + torch.randint(0, cfg.spread, (cfg.b,), generator=g)).tolist()
    elif not cfg.ragged:
        lens = [cfg.s_k] * cfg.b
    else:
        x = torch.normal(float(cfg.s_k), cfg.s_k / 2, (cfg.b,), generator=g)
        lens = x.round().clamp(MAX_SQ, 2 * cfg.s_k).long().tolist()
    return lens[:-1] + [cfg.long_len] if cfg.long_len else lens


def bytes_moved(sum_len: int, b: int, s_q: int, h: int, kv_bytes: int = 2, qo_bytes: int = 2) -> int:
    """The KV read once (576 per token) + q (576) and out (512) per (query token, head)."""
    return sum_len * HEAD * kv_bytes + b * s_q * h * QO * qo_bytes


def flops(sum_len: int, s_q: int, h: int) -> int:
    """2 * s_q * sum(len) * h * (576 + 512), FlashMLA's convention (causal masking ignored)."""
    return 2 * s_q * sum_len * h * QO


def gbps(nbytes: float, us: float) -> float:
    return nbytes / us / 1e3


def tflops(flop: float, us: float) -> float:
    return flop / us / 1e6


def metrics(cfg: Config, sum_len: int) -> dict:
    return {"sum_len": sum_len, "bytes": bytes_moved(sum_len, cfg.b, cfg.s_q, cfg.h),
            "bytes_fp8": bytes_moved(sum_len, cfg.b, cfg.s_q, cfg.h, kv_bytes=1), "flop": flops(sum_len, cfg.s_q, cfg.h)}


# ----------------------------------------------------------------------------- timing
def sm_clock_reader(device):
    """A zero-argument call giving ``device``'s SM clock in MHz through NVML (``torch.cuda.clock_rate``), or None where
    NVML cannot be read (no pynvml, no NVIDIA GPU)."""
    try:
        torch.cuda.clock_rate(device)
    except Exception:  # noqa: BLE001 - whatever stops NVML means "no clock in the records"
        return None
    return lambda: torch.cuda.clock_rate(device)


class Timer:
    """Median of CUDA-event timings; the L2 is flushed (a buffer zeroed) before every run. Where NVML is readable the
    SM clock is sampled while the timed runs execute (``sm_mhz``, the median sample): a kernel of tens of microseconds
    between flushes may run at another clock than one of milliseconds, which the GPU's power limit throttles."""

    def __init__(self, device, flush_mb: int = 256, budget_s: float = 0.25, reps: tuple = (10, 100)):
        self.flush = torch.empty(flush_mb << 20, dtype=torch.int8, device=device)
        self.budget_s, self.reps = budget_s, reps
        self.read_sm_mhz = sm_clock_reader(device)

    @staticmethod
    def host_us(fn, n: int = 5) -> float:
        """Host-side cost of one call (launch overhead), no sync inside the window."""
        ts = []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(ts)

    def __call__(self, fn, reps: int = 0, host_us: float = 50.0) -> dict:
        spin = int((2 * host_us + 20) * 2000)  # cycles (~2 GHz): the call is enqueued before the start event fires
        once = self._run(fn, 1, spin)[0][0]
        if reps <= 0:  # as many as fit the time budget (+ ~100 us flush + spin per run)
            reps = max(self.reps[0], min(self.reps[1], int(self.budget_s / ((once + 120 + 2 * host_us) * 1e-6))))
        ts, sm_mhz = self._run(fn, reps, spin)
        return {"us": statistics.median(ts), "min_us": min(ts), "reps": reps, "host_us": host_us, "sm_mhz": sm_mhz}

    def _run(self, fn, reps: int, spin: int) -> tuple[list[float], float | None]:
        """The reps' times in µs, and the median SM clock sampled while they ran (None without NVML)."""
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in ev:
            self.flush.zero_()
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(spin)
            start.record()
            fn()
            end.record()
        clocks = []
        if self.read_sm_mhz is not None:  # while the GPU works through the enqueued runs
            while not ev[-1][1].query():
                clocks.append(self.read_sm_mhz())
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in ev], (statistics.median(clocks) if clocks else None)


def as_graph(fn):
    """Capture one call into a CUDA graph; returns ``(replay, graph)``, ``replay()`` giving the output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return (lambda: (g.replay(), out)[1]), g


# ----------------------------------------------------------------------------- data and implementations
class Skip(Exception):
    """An impl that cannot run a config (the message says why)."""


def block_table(lens: list[int], page: int, seed: int) -> tuple[torch.Tensor, int]:
    """int32 ``[b, max_pages]`` over a random permutation of page ids (rows zero-padded), and the page count."""
    npages = torch.tensor([-(-n // page) for n in lens])
    total, maxp = int(npages.sum()), max(int(npages.max()), 1)
    table = torch.zeros(len(lens), maxp, dtype=torch.int32)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 17))
    table[torch.arange(maxp)[None, :] < npages[:, None]] = perm.int()
    return table, total


class KVGroup:
    """KV cache, lengths and block table, shared by the configs with one ``kv_key`` (all h and s_q)."""

    def __init__(self, cfg: Config, seed: int, device, fp8: bool, lens: list[int] | None = None):
        self.lens = lens or seq_lens(cfg, seed)
        self.sum_len, self.max_len = sum(self.lens), max(self.lens)
        table, total = block_table(self.lens, cfg.page, seed)
        self.block_table = table.to(device)
        self.seqlens = torch.tensor(self.lens, dtype=torch.int32, device=device)
        torch.manual_seed(seed)
        self.kv = torch.randn(total, cfg.page, HEAD, dtype=torch.bfloat16, device=device)
        self.kv_fp8 = self.kv.div(K_SCALE).to(torch.float8_e4m3fn) if fp8 else None


class Case:
    """One config's inputs: q in every layout, our metadata with its plan attached, the planner."""

    def __init__(self, cfg: Config, kvg: KVGroup, seed: int, device):
        from .metadata import MLADecodeMetadata
        from .planner import SplitPlanner

        self.cfg, self.kvg, self.T = cfg, kvg, cfg.b * cfg.s_q
        torch.manual_seed(seed + 1000 * cfg.h + cfg.s_q)
        self.q = torch.randn(self.T, cfg.h, HEAD, dtype=torch.bfloat16, device=device)
        self.q_nope, self.q_pe = self.q[..., :LATENT].contiguous(), self.q[..., LATENT:].contiguous()
        self.cu_q = torch.arange(cfg.b + 1, dtype=torch.int32, device=device) * cfg.s_q
        self.md = MLADecodeMetadata.from_block_table(kvg.block_table, kvg.seqlens, cfg.page, q_len=cfg.s_q,
                                                     max_kv_len=kvg.max_len)
        self.planner = SplitPlanner(cfg.b, cfg.h, cfg.s_q, device)
        self.md.plan = self.planner.plan(kvg.seqlens)


def load_anchors(wanted) -> dict:
    """The anchors' kernels by name (vLLM 0.26's; sgl-kernel's for flashmla-sgl): the module / functions, or a string
    saying why they are skipped."""
    out = {}
    for name in wanted:
        try:
            if name == "flashmla":
                from vllm.v1.attention.ops import flashmla as fm
                ok, why = fm.is_flashmla_dense_supported()
                out[name] = fm if ok else f"vLLM FlashMLA unsupported here: {why}"
            elif name == "fa3":
                from vllm.vllm_flash_attn import (fa_version_unsupported_reason, flash_attn_varlen_func,
                                                  get_scheduler_metadata, is_fa_version_supported)
                out[name] = ((flash_attn_varlen_func, get_scheduler_metadata) if is_fa_version_supported(3)
                             else f"FA3 unsupported here: {fa_version_unsupported_reason(3)}")
            elif name == FLASHMLA_SGL:
                from sgl_kernel import flash_mla as sfm
                out[name] = sfm
            elif name == "triton":
                from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
                out[name] = decode_attention_fwd
        except Exception as e:  # noqa: BLE001 - whatever stops the import means "skip, with the reason"
            engine = "SGLang" if name == FLASHMLA_SGL else "vLLM"
            out[name] = f"cannot import {engine}'s {name} kernel: {type(e).__name__}: {e}"
    return out


def concat_quantise_q(q_nope: torch.Tensor, q_pe: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's decode q for an fp8 FlashMLA call (MLAAttention's concat-and-quantise op in its native form):
    ``(q_nope [T, H, 512], q_pe [T, H, 64], scale [1] fp32) -> [T, H, 576]`` e4m3, ``q / scale`` clamped to +-448."""
    q = torch.cat((q_nope, q_pe), dim=-1).to(torch.float32) * scale.reciprocal()
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def compiled_concat_quantise_q():
    """``concat_quantise_q`` as vLLM runs it in a layer: compiled into one kernel (dynamic shapes: one compile)."""
    return torch.compile(concat_quantise_q, dynamic=True)


def make_runner(name: str, c: Case, anchors: dict, graphs: bool):
    """A zero-argument call returning the output as ``[b * s_q, h, 512]``; raises Skip with the reason."""
    cfg, kvg, fp8, base = c.cfg, c.kvg, fp8_kv(name), base_impl(name)
    kv = kvg.kv_fp8 if fp8 else kvg.kv
    dev = kv.device
    if base == "ours":
        from .dispatch import REFERENCE, select_impl
        from .op import mla_decode

        choice = select_impl(dev, torch.bfloat16, kv.dtype, cfg.h, cfg.s_q, cfg.page)
        if choice.impl == REFERENCE:
            raise Skip(f"no kernel: {choice.reason}")
        fp8_compute = name == FP8_COMPUTE
        if fp8_compute and not fp8_compute_applies(choice.impl.split("-", 1)[1], cfg.h, cfg.s_q, True):
            raise Skip(f"fp8 compute takes {FP8_COMPUTE_MIN_ROWS}+ rows (heads x s_q): ours-fp8 is this kernel")
        out = torch.empty(c.T, cfg.h, LATENT, dtype=torch.bfloat16, device=dev)
        ks = K_SCALE if fp8 else None
        return lambda: mla_decode((c.q_nope, c.q_pe), kv, c.md, SOFTMAX_SCALE, k_scale=ks, out=out,
                                  impl=choice.impl, check_indices=False, fp8_compute=fp8_compute)
    mod = anchors.get(base)
    if not mod or isinstance(mod, str):
        raise Skip(mod or "not requested")
    if base == "flashmla":  # as vllm/v1/attention/backends/mla/flashmla.py FlashMLAImpl.forward_mqa calls it
        if cfg.page != 64:
            raise Skip("vLLM FLASHMLA takes kernel block size 64 only")
        q4, k4 = c.q.view(cfg.b, cfg.s_q, cfg.h, HEAD), kv.unsqueeze(-2)
        if not fp8:  # the sched meta is filled by the first (warm-up) call, then reused: same shapes and lengths
            meta, _ = mod.get_mla_metadata(kvg.seqlens, cfg.s_q * cfg.h, 1, is_fp8_kvcache=False)
            fn = lambda: mod.flash_mla_with_kvcache(  # noqa: E731
                q=q4, k_cache=k4, block_table=kvg.block_table, cache_seqlens=kvg.seqlens, head_dim_v=LATENT,
                tile_scheduler_metadata=meta, softmax_scale=SOFTMAX_SCALE, causal=True, is_fp8_kvcache=False)[0]
        else:  # vLLM quantises q to fp8 for this path too; per-tensor descales
            tsm, nsp = mod.get_mla_metadata_dense_fp8(kvg.seqlens, cfg.s_q * cfg.h, 1)
            dq, dk = (torch.tensor([v], dtype=torch.float32, device=dev)
                      for v in (float(c.q.abs().max()) / FP8_MAX, K_SCALE))
            kernel = lambda q: mod.flash_mla_with_kvcache_fp8(  # noqa: E731
                q=q, k_cache=k4, block_table=kvg.block_table, cache_seqlens=kvg.seqlens, head_dim_v=LATENT,
                tile_scheduler_metadata=tsm, num_splits=nsp, softmax_scale=SOFTMAX_SCALE, causal=True,
                descale_q=dq, descale_k=dk)[0]
            if name == FLASHMLA_FP8_Q:
                quantise = compiled_concat_quantise_q()
                fn = lambda: kernel(quantise(c.q_nope, c.q_pe, dq).view(q4.shape))  # noqa: E731
            else:
                q8 = concat_quantise_q(c.q_nope, c.q_pe, dq).view(q4.shape)
                fn = lambda: kernel(q8)  # noqa: E731
        return lambda: fn().view(c.T, cfg.h, LATENT)
    if base == FLASHMLA_SGL:  # as sglang/srt/layers/attention/flashmla_backend.py calls it
        if cfg.page != 64 or fp8:
            raise Skip("flashmla-sgl is timed with a 16-bit cache and page 64 (SGLang's flashmla pool)")
        q4, k4 = c.q.view(cfg.b, cfg.s_q, cfg.h, HEAD), kv.unsqueeze(-2)
        tsm, nsp = mod.get_mla_metadata(kvg.seqlens, cfg.s_q * cfg.h, 1, is_fp8_kvcache=False)
        return lambda: mod.flash_mla_with_kvcache(
            q=q4, k_cache=k4, block_table=kvg.block_table, cache_seqlens=kvg.seqlens, head_dim_v=LATENT,
            tile_scheduler_metadata=tsm, num_splits=nsp, softmax_scale=SOFTMAX_SCALE, causal=True)[0].view(
                c.T, cfg.h, LATENT)
    if base == "fa3":  # as vllm/v1/attention/backends/mla/flashattn_mla.py calls it
        if cfg.page % 16:
            raise Skip("vLLM FLASH_ATTN_MLA needs a page size that is a multiple of 16")
        varlen, sched_fn = mod
        nsplit = 32 if graphs else 0  # vLLM: flash_attn_max_num_splits_for_cuda_graph (32) under full graphs
        sched = sched_fn(batch_size=cfg.b, max_seqlen_q=cfg.s_q, max_seqlen_k=kvg.max_len, num_heads_q=cfg.h,
                         num_heads_kv=1, headdim=ROPE, cache_seqlens=kvg.seqlens, qkv_dtype=kv.dtype,
                         headdim_v=LATENT, page_size=cfg.page, cu_seqlens_q=c.cu_q, causal=True, num_splits=nsplit)
        k_pe, kv_c = kv[..., LATENT:].unsqueeze(-2), kv[..., :LATENT].unsqueeze(-2)
        return lambda: varlen(q=c.q_pe, k=k_pe, v=kv_c, q_v=c.q_nope, max_seqlen_q=cfg.s_q, cu_seqlens_q=c.cu_q,
                              max_seqlen_k=kvg.max_len, seqused_k=kvg.seqlens, block_table=kvg.block_table,
                              softmax_scale=SOFTMAX_SCALE, causal=True, fa_version=3, scheduler_metadata=sched,
                              num_splits=nsplit)
    if base == "triton":  # as vllm/v1/attention/backends/mla/triton_mla.py TritonMLAImpl.forward_mqa calls it
        if cfg.s_q != 1 or cfg.page % 16:
            raise Skip("vLLM TRITON_MLA decodes s_q=1 only, with a page size that is a multiple of 16")
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # triton_mla._compute_num_kv_splits: next_power_of_2(max(1, max_seq_len // 512)) capped at 2 * SMs
        nsplit = min(1 << math.ceil(math.log2(max(1, kvg.max_len // 512))), 2 * sms)
        o = torch.zeros(cfg.b, cfg.h, LATENT, dtype=torch.bfloat16, device=dev)
        lse = torch.zeros(cfg.b, cfg.h, dtype=torch.bfloat16, device=dev)
        logits = torch.empty(cfg.b, cfg.h, nsplit, LATENT + 1, dtype=torch.float32, device=dev)
        ks, kv4 = torch.tensor(K_SCALE if fp8 else 1.0, device=dev), kv.unsqueeze(2)
        return lambda: (mod(c.q, kv4, kv4[..., :LATENT], o, lse, kvg.block_table, kvg.seqlens, logits, nsplit,
                            SOFTMAX_SCALE, cfg.page, k_scale=ks, v_scale=ks, is_mla=True), o)[1]
    raise Skip(f"unknown impl {name}")


# ----------------------------------------------------------------------------- correctness checks
def compare(name: str, out, ref, what: str) -> str:
    d = (out.float() - ref.float()).abs().max().item()
    rel = d / max(ref.float().abs().max().item(), 1e-30)
    tol = tolerance(name)
    return (f"  {name:<13} vs {what}: max abs {d:.2e} rel {rel:.2e}"
            + ("" if rel <= tol else f"  WARNING: mismatch (tolerance {tol:g})"))


def check_small(h: int, s_q: int, page: int, name: str, device) -> str:
    """Ours ``name`` (index checks on) vs the fp32 reference on a tiny ragged config of one variant."""
    from .op import mla_decode
    from .reference import mla_decode_reference

    cfg = Config(3, 400, h, s_q, True, page)
    fp8 = fp8_kv(name)
    c = Case(cfg, KVGroup(cfg, 7, device, fp8, lens=[s_q, 130, 777]), 7, device)
    kv, ks = (c.kvg.kv_fp8, K_SCALE) if fp8 else (c.kvg.kv, None)
    ref, _ = mla_decode_reference(c.q_nope, c.q_pe, kv, c.md, SOFTMAX_SCALE, ks or 1.0)
    out = mla_decode(c.q, kv, c.md, SOFTMAX_SCALE, k_scale=ks, fp8_compute=name == FP8_COMPUTE)
    return compare(name, out, ref, f"fp32 reference (small check: h={h} s_q={s_q} page={page})")


def check_sampled(c: Case, outs: dict, n: int = 4) -> list[str]:
    """Every impl's output vs the fp32 reference on a few requests of this config (--check)."""
    from .metadata import MLADecodeMetadata
    from .reference import mla_decode_reference

    cfg, kvg, dev = c.cfg, c.kvg, c.q.device
    idx = sorted({0, cfg.b // 2, cfg.b - 1, max(range(cfg.b), key=kvg.lens.__getitem__)})[:n]
    ix = torch.tensor(idx, device=dev)
    rows = (ix[:, None] * cfg.s_q + torch.arange(cfg.s_q, device=dev)).reshape(-1)
    md = MLADecodeMetadata(kvg.seqlens[ix], torch.arange(len(idx) + 1, dtype=torch.int32, device=dev) * cfg.s_q,
                           kvg.block_table.reshape(-1), (ix * kvg.block_table.shape[1]).int(), cfg.page, cfg.s_q)
    refs = {fp8: mla_decode_reference(c.q_nope[rows], c.q_pe[rows], kvg.kv_fp8 if fp8 else kvg.kv, md,
                                      SOFTMAX_SCALE, K_SCALE if fp8 else 1.0)[0]
            for fp8 in {fp8_kv(n) for n in outs}}
    return [compare(n, o[rows], refs[fp8_kv(n)], f"fp32 reference ({len(idx)} requests)")
            for n, o in outs.items()]


def check_cross(outs: dict) -> list[str]:
    """Each impl vs ours (bf16 KV) or ours-fp8 (fp8 KV) on the whole output."""
    ref = {n: "ours-fp8" if fp8_kv(n) else "ours" for n in outs}
    return [compare(n, o, outs[ref[n]], ref[n]) for n, o in outs.items() if n != ref[n] and ref[n] in outs]


# ----------------------------------------------------------------------------- the run
def impl_list(impls: str, fp8: bool) -> list[str]:
    names = [n.strip() for n in impls.split(",") if n.strip()]
    if bad := [n for n in names if n not in IMPLS]:
        raise ValueError(f"unknown impl(s) {bad}; choose from {','.join(IMPLS)}")
    names += [m for n in names if fp8 and n in FP8_IMPLS for m in FP8_IMPLS[n]]
    return [n for n in ORDER if n in names]


def time_impl(name: str, c: Case, anchors: dict, args, timer: Timer, rec: dict, outs: dict, keep: bool) -> None:
    fn = make_runner(name, c, anchors, args.graphs)
    fn()  # warm-up: compiles / JITs, and fills FlashMLA's lazily built scheduler metadata
    torch.cuda.synchronize()
    graph = None
    if args.graphs:
        fn, graph = as_graph(fn)
    t = timer(fn, args.reps, timer.host_us(fn))
    nbytes = rec["bytes_fp8"] if fp8_kv(name) else rec["bytes"]
    rec["impls"][name] = {**t, "gbps": gbps(nbytes, t["us"]), "tflops": tflops(rec["flop"], t["us"])}
    if keep:
        outs[name] = fn().clone()
    del fn, graph


def precompile(cfgs: list[Config], impls: list[str], device) -> None:
    """Build every kernel variant of ours up front, in parallel processes (TileLang's disk cache)."""
    from . import warmup

    for fp8_compute, ours in ((False, (("ours", torch.bfloat16), ("ours-fp8", torch.float8_e4m3fn))),
                              (True, ((FP8_COMPUTE, torch.float8_e4m3fn),))):
        kv_dtypes = [d for n, d in ours if n in impls]
        shapes = list(dict.fromkeys((c.h, c.s_q, c.page, torch.bfloat16, kvd) for c in cfgs for kvd in kv_dtypes))
        if not shapes:
            continue
        try:
            ready = warmup(device, shapes=shapes, workers=min(len(shapes), os.cpu_count() or 1, 16), strict=False,
                           fp8_compute=fp8_compute)
            if ready.variants:
                print(f"ours: {len(ready.variants)} kernel variant(s) compiled or loaded in {ready.seconds:.0f}s")
        except Exception as e:  # noqa: BLE001 - each variant then compiles on first use
            print(f"WARNING: parallel kernel warm-up failed ({type(e).__name__}: {e}); compiling on first use")


def run(args, cfgs: list[Config], impls: list[str]) -> list[dict]:
    from .kernels import runtime

    device = torch.device(args.device)
    precompile(cfgs, impls, device)
    anchors = load_anchors({base_impl(n) for n in impls} - {"ours"})
    for name, mod in anchors.items():
        if isinstance(mod, str):
            print(f"skip {name}: {mod}")
    timer = Timer(device, args.flush_mb, *((0.08, (5, 30)) if args.quick else (0.25, (10, 100))))
    results, variants, classes, key, kvg = [], set(), set(), None, None
    for i, cfg in enumerate(cfgs, 1):
        if cfg.kv_key() != key:
            kvg = None  # free the previous group's cache before allocating the next one
            torch.cuda.empty_cache()
            key, kvg = cfg.kv_key(), KVGroup(cfg, args.seed, device, args.fp8)
        c = Case(cfg, kvg, args.seed, device)
        rec = {**dataclasses.asdict(cfg), "lens": cfg.lens, "label": cfg.label(), "max_len": kvg.max_len,
               **metrics(cfg, kvg.sum_len), "impls": {}, "checks": []}
        plan = lambda: c.planner.plan(kvg.seqlens)  # noqa: E731
        plan()
        host = timer.host_us(plan)
        rec["plan_us"], rec["plan_host_us"] = timer(plan, 20, host)["us"], host
        first_of_class = (cfg.h, cfg.s_q) not in classes
        classes.add((cfg.h, cfg.s_q))
        outs = {}
        for name in impls:
            try:
                if name.startswith("ours") and (cfg.h, cfg.s_q, cfg.page, name) not in variants:
                    variants.add((cfg.h, cfg.s_q, cfg.page, name))
                    t0 = runtime.STATS.seconds
                    rec["checks"].append(check_small(cfg.h, cfg.s_q, cfg.page, name, device))
                    print(rec["checks"][-1] + f" [compile/load {runtime.STATS.seconds - t0:.1f}s]")
                time_impl(name, c, anchors, args, timer, rec, outs, first_of_class)
            except Skip as e:
                rec["impls"][name] = {"skip": str(e)}
            except Exception as e:  # noqa: BLE001 - keep timing the other impls and configs
                rec["impls"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"WARNING: {name} failed on {cfg.label()}: {rec['impls'][name]['error']}")
        t = {n: v["us"] for n, v in rec["impls"].items() if "us" in v}
        best = min((t[n] for n in BEST_ANCHORS if n in t), default=None)
        rec["ratio"] = t["ours"] / best if best and "ours" in t else None
        if first_of_class:  # all impls vs each other, and (--check) vs the fp32 reference on sampled requests
            lines = check_cross(outs) + (check_sampled(c, outs) if args.check and outs else [])
            rec["checks"] += lines
            print("\n".join(lines)) if lines else None
        del outs, c
        cells = "  ".join(f"{n} {v['us']:.1f}" for n, v in rec["impls"].items() if "us" in v)
        print(f"[{i}/{len(cfgs)}] {cfg.label()}: {cells or 'nothing ran'}  (us; plan {rec['plan_us']:.1f})", flush=True)
        results.append(rec)
    return results


def dry_run(cfgs: list[Config], impls: list[str], fp8: bool) -> None:
    print(f"{len(cfgs)} configs; impls: {', '.join(impls)}")
    print(f"{'config':<38}{'kind':>8}{'sum_len':>11}{'bytes':>11}" + (f"{'fp8 bytes':>11}" if fp8 else "")
          + f"{'GFLOP':>9}{'us@3TB/s':>10}")
    for c in cfgs:
        m = metrics(c, sum(seq_lens(c)))
        print(f"{c.label():<38}{c.kind:>8}{m['sum_len']:>11}{m['bytes']:>11.4g}"
              + (f"{m['bytes_fp8']:>11.4g}" if fp8 else "") + f"{m['flop'] / 1e9:>9.1f}{m['bytes'] / 3e6:>10.1f}")
    variants = sorted({(c.h, c.s_q, c.page) for c in cfgs})
    print(f"our kernel variants (h, s_q, page){' x {bf16, fp8} KV' if fp8 else ''}: {variants}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mla-backend bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="12 representative configs (~3 min with the anchors)")
    p.add_argument("--grid", choices=("full", "flashmla", "latency", "pages", "mixed", "served"), default="full",
                   help="full = FlashMLA's grid (b, s_k, h, s_q, fixed/ragged) + latency cases + page sizes + "
                        "mixed (64 ragged ~1k-token requests, alone and with one of 16k) + served (16 and 64 "
                        f"requests of 4096 .. {4096 + SERVED_SPREAD - 1} tokens)")
    p.add_argument("--filter", action="append", metavar="EXPR",
                   help="keep configs matching e.g. 'b=128,h=16|32,s_k>=8192,lens=ragged,page=64' (a comma means "
                        "and; repeat the flag for or); keys: b s_k h s_q page lens kind long_len spread")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--fp8", action="store_true",
                   help=f"add float8_e4m3fn KV (scale {K_SCALE}): ours-fp8 (q in 16 bits), {FP8_COMPUTE} "
                        "(fp8_compute: q quantised, e4m3 tensor cores), vLLM's triton-fp8, flashmla-fp8 and "
                        f"{FLASHMLA_FP8_Q} (with vLLM's q quantisation in the timed call)")
    p.add_argument("--graphs", action="store_true", help="time CUDA-graph replays instead of eager calls")
    p.add_argument("--check", action="store_true",
                   help="also compare every impl with the fp32 reference on sampled requests, once per (h, s_q)")
    p.add_argument("--out-dir", default="mla_bench_results", help="bench.{csv,json,md,png} go here; '' = none")
    p.add_argument("--reps", type=int, default=0, help="timed runs per measurement (0 = auto, by a time budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flush-mb", type=int, default=256, help="size of the L2 flush buffer")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dry-run", action="store_true", help="list the configs with bytes and FLOP; run nothing")
    p.add_argument("--host", action="store_true",
                   help="time the host side of one call instead (mla_backend/bench_host.py; --host --help: its options)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0 when at least one implementation was timed (or --dry-run), 2 when nothing ran."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--host" in argv:
        from . import bench_host

        return bench_host.main([a for a in argv if a != "--host"])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfgs, impls = select(make_configs(args.grid, args.quick), args.filter), impl_list(args.impls, args.fp8)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        dry_run(cfgs, impls, args.fp8)
        return 0
    if not torch.cuda.is_available():
        return nothing_ran("bench", f"no CUDA GPU visible to torch {torch.__version__}; nothing to time "
                           "(--dry-run lists the configs with their bytes and FLOP).")
    if not cfgs:
        return nothing_ran("bench", "no config matches the filter; nothing to time.")
    import logging

    log = logging.getLogger("mla_backend")
    log.setLevel(logging.INFO)
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stdout))
    env = environment(argv)
    timing = (f"{'CUDA-graph replays' if args.graphs else 'Eager calls'}, median over many runs, L2 flushed "
              f"({args.flush_mb} MB write) before each; ours = the whole mla_decode call, combine kernel included, "
              "split plan precomputed (the planner is timed separately: plan µs)")
    settings = {"timing": timing, "graphs": args.graphs, "fp8": args.fp8, "k_scale": K_SCALE,
                "softmax_scale": SOFTMAX_SCALE, "seed": args.seed, "flush_mb": args.flush_mb}
    print(f"{env.get('gpu')}: torch {env['torch']}, triton {env['triton']}, vllm {env['vllm']}, "
          f"tilelang {env['tilelang']}; {len(cfgs)} configs, impls {', '.join(impls)}")
    t0 = time.perf_counter()
    results = run(args, cfgs, impls)
    for pkg in ("vllm", "tilelang"):  # unpacked without .dist-info: ask the imported module
        env[pkg] = env[pkg] or getattr(sys.modules.get(pkg), "__version__", None)
    files = save(args.out_dir, results, impls, env, settings) if args.out_dir else []
    print(f"done in {time.perf_counter() - t0:.0f}s" + (f"; wrote {', '.join(files)}" if files else ""))
    print(f"\n{timing}.\nCells: median us, GB/s, TFLOP/s. ours / best = ours time / min(flashmla, flashmla-sgl, fa3) "
          "(below 1: ours is faster).")
    print("\n".join(table(results, impls)))
    if not any("us" in v for r in results for v in r["impls"].values()):
        return nothing_ran("bench", "no implementation was timed on any config (see the skips and errors above).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
