"""``TileLangMLABackend``: an SGLang (0.5.17 API) ``AttentionBackend`` around the MLA decode op (one
:class:`mla_backend.MLADecodeLauncher` per layer).

What runs where:

* DECODE (and IDLE): absorbed MLA over the paged latent cache with the TileLang kernels.
* TARGET_VERIFY (EAGLE / MTP with ``--speculative-eagle-topk 1``): the same op with
  ``q_len = num_draft_tokens`` (<= 4) queries per request, causal among the drafts.
* Everything else (EXTEND / prefill, MIXED, DRAFT_EXTEND): delegated to one of SGLang's own backends, built
  with the same ``ModelRunner`` and held inside this object: ``FlashInferMLAAttnBackend`` (what ``flashmla``
  prefills with) where FlashInfer and a GPU are present, else ``TritonAttnBackend``
  (``MLA_BACKEND_SGLANG_PREFILL`` chooses).

Metadata: ``req_to_token`` -> row-strided page table (``page_table.py``) + KV lengths + split-KV
plan, all written into persistent buffers sized at ``init_cuda_graph_state``. For a batch that fits the
graph buffers these device ops are recorded into each captured graph by ``init_forward_metadata_in_graph``,
so a replay issues none of them from the host; SGLang writes the step's inputs into the graph's input
buffers before the replay, and the recorded ops read them there. With
``MLA_BACKEND_SGLANG_GRAPH_METADATA=0`` they run in ``init_forward_metadata_out_graph`` instead
(outside the graph, before every replay). Eager batches reuse the same buffers when they fit, else
grown eager buffers.

Unsupported configurations are refused in ``__init__`` (server startup) with a ``ValueError``
whose message starts with ``tilelang_mla:``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..constants import HEAD_DIM, KV_LORA_RANK, MAX_HEADS, MAX_Q_LEN, ROPE_DIM, SUPPORTED_PAGE_SIZES
from ..dispatch import ENV_IMPL, REFERENCE, engine_fp8_compute, engine_impl_request, select_impl, warmup
from ..host_trace import host_range
from ..launcher import MLADecodeLauncher
from ..metadata import INDEX_DTYPE, MLADecodeMetadata
from ..verify import verification_report, verifying
from ..planner import SplitPlanner
from . import BACKEND_NAME, ENV_PREFILL, ENV_REPORT, prefill_backend, prefill_request, set_prefill_in_use
from .page_table import (FillFn, fill_page_table_torch, max_pages_per_request, refill_decode_buffers,
                         sglang_decode_metadata)

logger = logging.getLogger("mla_backend.sglang")

#: Speculative algorithms whose verify step is a causal chain (topk 1) of <= 4 tokens.
SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")
#: Largest eager page table (bytes) sized from the static bound before falling back to a host sync.
_EAGER_STATIC_TABLE_BYTES = 64 << 20

ENV_WARMUP = "MLA_BACKEND_SGLANG_WARMUP"  # "0": do not compile the kernels at startup
ENV_PAGE_TABLE = "MLA_BACKEND_SGLANG_PAGE_TABLE"  # auto (default) | triton | torch
# "1": record the decode / verify metadata (page table, lengths, split plan) inside the captured CUDA graphs, so a
# replay issues no metadata work from the host. Opt-in; checked teacher-forced against flashmla on one GPU
# (docs/sglang.md).
ENV_GRAPH_METADATA = "MLA_BACKEND_SGLANG_GRAPH_METADATA"


def _build_extend_backend(model_runner) -> tuple[str, AttentionBackend]:
    """(name, backend) of the SGLang backend that serves prefill (see ``prefill_backend``). A FlashInfer backend
    chosen by default that cannot be built gives way to Triton with a warning; one asked for by name is refused."""
    name = prefill_backend()
    if name == "flashinfer":
        try:
            from sglang.srt.layers.attention.flashinfer_mla_backend import FlashInferMLAAttnBackend

            backend = FlashInferMLAAttnBackend(model_runner)
        except Exception as exc:  # noqa: BLE001 - any failure of SGLang's constructor
            why = f"{type(exc).__name__}: {exc}"
            if prefill_request() == "flashinfer":
                _refuse(f"{ENV_PREFILL}=flashinfer, but SGLang's FlashInferMLAAttnBackend cannot be built ({why}); "
                        f"supported: auto, flashinfer (with FlashInfer installed and a CUDA GPU) or triton")
            logger.warning("mla_backend: %s prefills with SGLang's Triton backend: FlashInferMLAAttnBackend cannot "
                           "be built (%s)", BACKEND_NAME, why)
            name = "triton"
    if name == "triton":
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend(model_runner)
    set_prefill_in_use(name)
    return name, backend


def _step_kind(forward_batch) -> str:
    """The report counter of a batch this backend attends: "verify" (TARGET_VERIFY) or "decode"."""
    return "verify" if forward_batch.forward_mode.is_target_verify() else "decode"


def _refuse(msg: str):
    raise ValueError(f"{BACKEND_NAME}: {msg}")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def parallel_value(name: str, default):
    """This process's parallel setting ``name`` (``tp_rank``, ``attn_tp_size``, ...) from SGLang's runtime context,
    or ``default`` where the installed SGLang has none."""
    try:
        from sglang.srt.runtime_context import get_parallel

        value = getattr(get_parallel(), name)
        return default if value is None else value
    except Exception:
        return default


def _spec_settings(model_runner) -> tuple[Optional[str], int, int]:
    """(algorithm name or None, eagle topk, num draft tokens) of the server."""
    sa = model_runner.server_args
    algo = getattr(sa, "speculative_algorithm", None)
    topk = getattr(sa, "speculative_eagle_topk", None)
    n_draft = getattr(sa, "speculative_num_draft_tokens", None)
    if n_draft is None or topk is None:  # fall back to the published runtime view (FlashMLA / Triton read it)
        try:
            from sglang.srt.runtime_context import get_spec

            spec = get_spec()
            n_draft = getattr(spec, "speculative_num_draft_tokens", None) if n_draft is None else n_draft
            topk = getattr(spec, "speculative_eagle_topk", None) if topk is None else topk
        except Exception:
            pass
    if algo is not None:
        algo = getattr(algo, "name", algo)
        algo = None if str(algo).upper() in ("", "NONE") else str(algo).upper()
    return algo, int(topk or 0), int(n_draft or 0)


@dataclass
class SupportedConfig:
    num_heads: int
    page_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    spec_algorithm: Optional[str]
    num_draft_tokens: int
    q_lens: tuple
    impl: str  # resolved implementation ("tilelang-sm90", ... or "reference")
    impl_request: str  # what MLA_BACKEND_IMPL asked for
    fp8_compute: bool = False  # an fp8 pool on e4m3 tensor cores (unless MLA_BACKEND_FP8_COMPUTE=0)


def check_supported(model_runner) -> SupportedConfig:
    """Refuse, at startup, every SGLang configuration the decode op cannot serve."""
    if getattr(model_runner, "is_draft_worker", False):
        _refuse("cannot be the speculative draft model's backend (SGLang's draft-backend factory has "
                "no entry for out-of-tree backends). Add --speculative-draft-attention-backend triton "
                "(or flashinfer / fa3 / flashmla).")
    if not getattr(model_runner, "use_mla_backend", False):
        _refuse("only serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2, ...); this model uses "
                "standard attention. Pick another --attention-backend.")
    mc = model_runner.model_config
    kv_lora_rank = getattr(mc, "kv_lora_rank", None)
    rope_dim = getattr(mc, "qk_rope_head_dim", None)
    if kv_lora_rank != KV_LORA_RANK or rope_dim != ROPE_DIM:
        _refuse(f"kernels are built for kv_lora_rank={KV_LORA_RANK}, qk_rope_head_dim={ROPE_DIM} "
                f"(DeepSeek-V3 MLA); this model has kv_lora_rank={kv_lora_rank}, qk_rope_head_dim={rope_dim}.")
    if getattr(mc, "is_encoder_decoder", False):
        _refuse("encoder-decoder models (cross attention) are not supported.")
    pool = model_runner.token_to_kv_pool
    if getattr(pool, "use_dsa", False) or "DSA" in type(pool).__name__ or "FP4" in type(pool).__name__ \
            or getattr(pool, "kv_cache_dim", HEAD_DIM) != HEAD_DIM:
        _refuse(f"needs SGLang's plain MLA KV pool ([tokens, 1, {HEAD_DIM}]); got {type(pool).__name__} "
                "(DeepSeek sparse attention / FP4 caches are not supported).")
    sliding_window = getattr(model_runner, "sliding_window_size", None)
    if sliding_window is not None and sliding_window > 0:
        _refuse(f"sliding-window attention (window {sliding_window}) is not supported.")
    allocator = getattr(model_runner, "token_to_kv_pool_allocator", None)
    if getattr(allocator, "full_v2p_page_table", None) is not None or \
            getattr(model_runner.server_args, "enable_unified_memory", False):
        _refuse("the unified memory pool (--enable-unified-memory) is not supported: req_to_token "
                "holds virtual ids there.")
    dcp = int(parallel_value("attn_dcp_size", 1) or 1)
    if dcp > 1:
        _refuse(f"decode context parallelism (dcp size {dcp}) is not supported.")

    dtype = model_runner.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        _refuse(f"model dtype {dtype} is not supported (float16 or bfloat16).")
    kv_dtype = model_runner.kv_cache_dtype
    if kv_dtype not in (dtype, torch.float8_e4m3fn):
        _refuse(f"KV cache dtype {kv_dtype} is not supported: use the model dtype (--kv-cache-dtype auto) "
                "or --kv-cache-dtype fp8_e4m3.")

    attn_tp = int(parallel_value("attn_tp_size", getattr(model_runner, "tp_size", 1)) or 1)
    num_heads = mc.num_attention_heads // attn_tp
    if not 1 <= num_heads <= MAX_HEADS:
        _refuse(f"{num_heads} query heads per rank ({mc.num_attention_heads} heads / attention TP "
                f"{attn_tp}); the kernels take 1..{MAX_HEADS}. Raise --tp-size (or the attention TP).")
    page_size = int(getattr(model_runner, "page_size", 1) or 1)
    if page_size not in SUPPORTED_PAGE_SIZES:
        _refuse(f"--page-size {page_size} is not supported; use one of {list(SUPPORTED_PAGE_SIZES)} "
                "(64 recommended).")

    algo, topk, n_draft = _spec_settings(model_runner)
    if algo is not None:
        if algo not in SPEC_ALGORITHMS:
            _refuse(f"speculative algorithm {algo} is not supported (verify needs a causal chain); "
                    f"supported: {', '.join(SPEC_ALGORITHMS)} with --speculative-eagle-topk 1.")
        if topk > 1:
            _refuse(f"--speculative-eagle-topk {topk} (tree verify) is not supported; use "
                    "--speculative-eagle-topk 1.")
        if not 1 <= n_draft <= MAX_Q_LEN:
            _refuse(f"--speculative-num-draft-tokens {n_draft} is not supported; the kernels take "
                    f"1..{MAX_Q_LEN} (e.g. --speculative-num-steps 3 --speculative-num-draft-tokens 4).")
    q_lens = (1,) + ((n_draft,) if 1 < n_draft <= MAX_Q_LEN else ())

    try:
        impl_request = engine_impl_request()
        fp8_compute = engine_fp8_compute() and kv_dtype == torch.float8_e4m3fn  # a bad value refused always
    except ValueError as exc:
        _refuse(f"{exc}")
    device = model_runner.req_to_token_pool.req_to_token.device
    choice = None
    for q_len in q_lens:
        try:
            choice = select_impl(device, dtype, kv_dtype, num_heads, q_len, page_size, impl_request)
        except ValueError as exc:
            _refuse(f"{exc}")
        if choice.impl == REFERENCE and impl_request != REFERENCE:
            _refuse(f"no TileLang kernel can run this setup ({choice.reason}). On an MI300X, "
                    f"{ENV_IMPL}=tilelang-gfx942 opts into the gfx942 kernel (unverified on hardware, docs/amd.md); "
                    f"for debugging only, {ENV_IMPL}=reference runs the slow PyTorch reference "
                    "(needs --disable-cuda-graph).")
    return SupportedConfig(num_heads, page_size, dtype, kv_dtype, algo, n_draft, q_lens, choice.impl,
                           impl_request, fp8_compute)


#: Where SGLang keeps its FlashMLA block-table kernel: 0.5.17 re-exports it from attention.utils (defined in
#: kvcache.kv_indices); 0.5.23 defines it in attention.kv_indices and attention.utils no longer has it.
_FLASHMLA_KV_INDICES_MODULES = (
    "sglang.kernels.ops.attention.kv_indices",
    "sglang.kernels.ops.attention.utils",
    "sglang.kernels.ops.kvcache.kv_indices",
)


def _flashmla_kv_indices_kernel():
    """``(create_flashmla_kv_indices_triton, get_num_kv_index_blocks_flashmla)`` from the first module
    of :data:`_FLASHMLA_KV_INDICES_MODULES` that has both; raises ImportError if none has."""
    import importlib

    errors = []
    for name in _FLASHMLA_KV_INDICES_MODULES:
        try:
            module = importlib.import_module(name)
            return module.create_flashmla_kv_indices_triton, module.get_num_kv_index_blocks_flashmla
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    raise ImportError("SGLang's create_flashmla_kv_indices_triton not found (" + "; ".join(errors) + ")")


def _make_triton_fill() -> Optional[FillFn]:
    """SGLang's FlashMLA block-table kernel (any power-of-two page size), or None if unavailable."""
    try:
        create_flashmla_kv_indices_triton, get_num_kv_index_blocks_flashmla = _flashmla_kv_indices_kernel()
    except Exception as exc:  # pragma: no cover - depends on the SGLang build
        logger.warning("mla_backend: SGLang's page-table kernel is unavailable (%s); using torch", exc)
        return None

    def fill_page_table_triton(req_to_token, req_pool_indices, kv_lens, page_size, out):
        bs, width = out.shape
        if bs == 0:
            return
        # Writes out[r, j] = req_to_token[req_pool_indices[r], j * P] // P for j < ceil(kv_lens[r] / P);
        # the grid covers the static width, CTAs past a request's last page exit at once.
        create_flashmla_kv_indices_triton[(bs, get_num_kv_index_blocks_flashmla(width, page_size))](
            req_to_token, req_pool_indices, kv_lens, None, out,
            req_to_token.stride(0), out.stride(0), PAGED_SIZE=page_size)

    return fill_page_table_triton


@dataclass
class DecodeForwardMetadata:
    """``forward_metadata`` of a DECODE / TARGET_VERIFY batch."""

    metadata: MLADecodeMetadata
    q_len: int
    batch_size: int
    kv_indptr: torch.Tensor  # int32 [bs + 1] (row-strided page table offsets)
    qo_indptr: torch.Tensor  # int32 [bs + 1]


@dataclass
class _Buffers:
    """Persistent decode metadata storage: the CUDA graphs' (refilled before each replay), or eager batches'."""

    max_bs: int
    width: int
    page_table: torch.Tensor  # int32 [max_bs, width]
    kv_indptr: torch.Tensor  # int32 [max_bs + 1] = arange * width
    kv_lens: torch.Tensor  # int32 [max_bs]
    qo_indptr: dict = field(default_factory=dict)  # q_len -> int32 [max_bs + 1]
    planners: dict = field(default_factory=dict)  # q_len -> SplitPlanner(max_bs)
    # (q_len, bs) -> DecodeForwardMetadata over views of these buffers, built at a batch size's first step: later
    # steps only refill the buffers and the plan (device ops), as a captured graph reads them
    decode: dict = field(default_factory=dict)


class TileLangMLABackend(AttentionBackend):
    """SGLang attention backend: TileLang MLA decode / verify, SGLang's FlashInfer MLA or Triton backend for
    everything else."""

    # Page-table widths come from the static context bound; the CPU mirror is optional (used only to
    # size eager tables) so SGLang's overlap scheduler need not publish it for us.
    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner):
        super().__init__()
        cfg = check_supported(model_runner)
        self.config = cfg
        self.model_runner = model_runner
        # the pools SGLang's forward context reads from the running backend (get_req_to_token_pool(), ...)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.device = self.req_to_token.device
        self.page_size = cfg.page_size
        self.num_heads = cfg.num_heads
        self.q_data_type = cfg.dtype
        self.kv_cache_dtype = self.data_type = cfg.kv_dtype
        self.is_fp8_kvcache = cfg.kv_dtype == torch.float8_e4m3fn
        self.num_draft_tokens = cfg.num_draft_tokens
        self.max_context_len = model_runner.model_config.context_len
        # The implementation resolved at startup, passed explicitly so that a runtime mismatch raises
        # instead of silently falling back to the (host-syncing, graph-unsafe) reference.
        self.impl = cfg.impl
        # Static page-table width: any request req_to_token can describe.
        self.width_static = max_pages_per_request(self.req_to_token.shape[1], self.page_size)
        self.forward_metadata: Optional[DecodeForwardMetadata] = None
        self._graph: Optional[_Buffers] = None
        self._retired_graph_buffers: list = []
        self._eager: Optional[_Buffers] = None  # batches the graph buffers do not fit (grown, never shrunk)
        self._eager_planners: dict = {}
        self._launchers: dict[int, MLADecodeLauncher] = {}  # layer_id -> its launcher, built at its first decode
        self._verify_mask = None
        self._fill: FillFn = self._choose_fill()
        # Prefill / extend / mixed: one of SGLang's backends, same runner (reads the same pools).
        self.prefill_backend_name, self.extend_backend = _build_extend_backend(model_runner)
        self._report_dir = os.environ.get(ENV_REPORT)
        graph_metadata = os.environ.get(ENV_GRAPH_METADATA, "1").strip()
        if graph_metadata not in ("0", "1"):
            _refuse(f"{ENV_GRAPH_METADATA}={graph_metadata!r} is not supported: 1 records the decode metadata inside "
                    "the CUDA graphs (the default), 0 builds it from the host before every replay")
        self._graph_metadata = graph_metadata == "1"
        # metadata_host_s: host time spent issuing the decode / verify metadata (page table, lengths, plan) before
        # each step or graph replay; reported per call, to weigh against the engine's step time
        self._stats = {"decode": 0, "verify": 0, "extend": 0, "graph_state": None, "metadata_host_s": 0.0}
        self._report_name = f"{BACKEND_NAME}-{os.getpid()}-{id(self):x}.json"
        # names the process in the report
        self._tp_rank = parallel_value("tp_rank", getattr(model_runner, "tp_rank", None))
        if cfg.impl != REFERENCE and os.environ.get(ENV_WARMUP, "1") != "0":
            self._warmup()
        logger.info("mla_backend: %s backend ready (heads=%d page=%d dtype=%s kv=%s q_lens=%s impl=%s prefill=%s)",
                    BACKEND_NAME, self.num_heads, self.page_size, cfg.dtype, cfg.kv_dtype, cfg.q_lens, cfg.impl,
                    self.prefill_backend_name)
        self._write_report()

    # ------------------------------------------------------------------ setup helpers
    def _choose_fill(self) -> FillFn:
        mode = os.environ.get(ENV_PAGE_TABLE, "auto")
        if mode == "torch" or self.device.type != "cuda":
            return fill_page_table_torch
        fill = _make_triton_fill()
        if fill is None:
            if mode == "triton":
                _refuse(f"{ENV_PAGE_TABLE}=triton but SGLang's create_flashmla_kv_indices_triton is unavailable")
            return fill_page_table_torch
        return fill

    def _warmup(self):
        """Compile (or load from TileLang's disk cache) every kernel variant before graph capture, and the planners
        of eager batches (up to every running request, sized per power of two)."""
        try:
            # req_to_token has max_running_requests + 1 rows; a batch holds at most max_running_requests requests
            # (4096 by default: the largest planner the package ships, where one more row would compile another)
            cfg = self.config
            ready = warmup(self.device, self.num_heads, cfg.q_lens, self.page_size, cfg.dtype, cfg.kv_dtype,
                           impl=cfg.impl, max_batch=max(1, self.req_to_token.shape[0] - 1), fp8_compute=cfg.fp8_compute)
        except Exception as exc:
            _refuse(f"kernel compilation failed for heads={self.num_heads} q_lens={self.config.q_lens} "
                    f"page={self.page_size}: {type(exc).__name__}: {exc}")
        logger.info("mla_backend: %s kernels ready in %.1fs (%d planner variants)", BACKEND_NAME, ready.seconds,
                    ready.plan_variants)

    def _write_report(self):
        if not self._report_dir:
            return
        try:
            os.makedirs(self._report_dir, exist_ok=True)
            info = {"backend": BACKEND_NAME, "pid": os.getpid(), "tp_rank": self._tp_rank, "impl": self.config.impl,
                    "heads": self.num_heads, "page_size": self.page_size, "dtype": str(self.config.dtype),
                    "kv_dtype": str(self.config.kv_dtype), "fp8_compute": self.config.fp8_compute,
                    "q_lens": list(self.config.q_lens),
                    "spec_algorithm": self.config.spec_algorithm, "num_draft_tokens": self.num_draft_tokens,
                    "page_table_fill": getattr(self._fill, "__name__", "?"),
                    "prefill_backend": self.prefill_backend_name, **self._stats,
                    "metadata_host_us_per_call": round(
                        1e6 * self._stats["metadata_host_s"] / max(1, self._stats["decode"] + self._stats["verify"]), 1)}
            report = verification_report()
            if report is not None:
                info["mla_backend_verify"] = report
            tmp = os.path.join(self._report_dir, self._report_name + ".tmp")
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, os.path.join(self._report_dir, self._report_name))
        except OSError:
            pass

    def _count(self, key: str):
        if self._report_dir:
            self._stats[key] += 1
            if self._stats[key] % 64 == 1 or verifying():  # verifying: every call (already syncs per call)
                self._write_report()

    # ------------------------------------------------------------------ metadata
    @staticmethod
    def _is_ours(forward_mode) -> bool:
        return forward_mode.is_decode_or_idle() or forward_mode.is_target_verify()

    def init_forward_metadata(self, forward_batch):
        """Eager entry point (no CUDA graph)."""
        if self._is_ours(forward_batch.forward_mode):
            self.forward_metadata = self._build_metadata(forward_batch)
        else:
            self._count("extend")
            self.forward_metadata = None
            self.extend_backend.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before capture (``in_capture``) and before every replay: refill the persistent buffers."""
        if self._is_ours(forward_batch.forward_mode):
            if self._graph_metadata and not in_capture and self._fits_graph(forward_batch.batch_size):
                # replay: the graph refills the buffers itself (recorded by init_forward_metadata_in_graph)
                self._count(_step_kind(forward_batch))
                return
            # before capture this eager build also runs the page-table kernel's JIT outside the capture
            self.forward_metadata = self._build_metadata(forward_batch)
        else:
            self.forward_metadata = None
            self.extend_backend.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Inside capture (and SGLang's eager runs): the decode metadata's device ops, recorded into the graph;
        with ``MLA_BACKEND_SGLANG_GRAPH_METADATA=0`` nothing (it is built out of graph)."""
        if not self._is_ours(forward_batch.forward_mode):
            self.extend_backend.init_forward_metadata_in_graph(forward_batch)
        elif self._graph_metadata and self._fits_graph(forward_batch.batch_size):
            self.forward_metadata = self._build_metadata(forward_batch)

    def _fits_graph(self, bs) -> bool:
        """A batch of ``bs`` requests fits the graph buffers, so its metadata lives in them (as in a captured graph)."""
        return self._graph is not None and int(bs) <= self._graph.max_bs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.config.impl == REFERENCE and self.device.type == "cuda":
            _refuse(f"{ENV_IMPL}=reference cannot run under CUDA graphs; add --disable-cuda-graph.")
        if self._graph is not None:
            if self._graph.max_bs >= max_bs:
                return  # graphs captured so far keep reading these buffers
            # Keep the old buffers alive: graphs captured against them must never read freed memory.
            self._retired_graph_buffers.append(self._graph)
        width = self.width_static
        dev = self.device
        self._graph = _Buffers(
            max_bs=max_bs,
            width=width,
            page_table=torch.zeros(max_bs, width, dtype=INDEX_DTYPE, device=dev),
            kv_indptr=torch.arange(max_bs + 1, dtype=INDEX_DTYPE, device=dev) * width,
            kv_lens=torch.ones(max_bs, dtype=INDEX_DTYPE, device=dev),
        )
        for q_len in self.config.q_lens:
            self._qo_indptr(self._graph, q_len)
        self._stats["graph_state"] = [max_bs, max_num_tokens, width]
        if self.num_draft_tokens:
            try:  # like FlashMLA: verify is causal, so the draft stage needs no dense tree mask
                from sglang.srt.layers.attention.verify_mask import maybe_create_verify_mask

                self._verify_mask = maybe_create_verify_mask(
                    is_draft_runner=False, skip_prefill=False, max_bs=max_bs,
                    max_context_len=self.max_context_len, num_draft_tokens=self.num_draft_tokens,
                    device=dev, is_read=False)
            except Exception as exc:  # pragma: no cover
                logger.info("mla_backend: no verify-mask scratch (%s)", exc)
                self._verify_mask = None

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded requests get seq_len 1 (request row 0: page 0, SGLang's dummy page).
        return 1

    @property
    def verify_mask(self):
        return self._verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        # Verify is causal over the drafts (topk 1): nothing depends on the draft's tree mask.
        pass

    def _qo_indptr(self, buffers: _Buffers, q_len: int) -> torch.Tensor:
        t = buffers.qo_indptr.get(q_len)
        if t is None:
            t = buffers.qo_indptr[q_len] = torch.arange(buffers.max_bs + 1, dtype=INDEX_DTYPE,
                                                        device=self.device) * q_len
        return t

    def _planner(self, q_len: int, bs: int) -> SplitPlanner:
        g = self._graph
        if self._fits_graph(bs):
            planner = g.planners.get(q_len)
            if planner is None:
                planner = g.planners[q_len] = SplitPlanner(g.max_bs, self.num_heads, q_len, self.device)
            return planner
        planner = self._eager_planners.get(q_len)
        if planner is None or planner.max_batch < bs:
            planner = self._eager_planners[q_len] = SplitPlanner(_pow2(bs), self.num_heads, q_len, self.device)
        return planner

    def _verify_q_len(self, forward_batch) -> int:
        spec_info = getattr(forward_batch, "spec_info", None)
        n = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        n = int(n) if n else self.num_draft_tokens
        if not 1 <= n <= MAX_Q_LEN:
            raise RuntimeError(f"{BACKEND_NAME}: TARGET_VERIFY with {n} draft tokens per request "
                               f"(supported 1..{MAX_Q_LEN})")
        return n

    def _eager_width(self, forward_batch, bs: int, n_draft: int) -> int:
        seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if seq_lens_cpu is not None:
            max_len = int(seq_lens_cpu[:bs].max()) + n_draft
        elif bs * self.width_static * 4 <= _EAGER_STATIC_TABLE_BYTES:
            return self.width_static
        else:  # no CPU mirror and a big static table: one host sync
            max_len = int(forward_batch.seq_lens[:bs].max()) + n_draft
        return min(max_pages_per_request(max_len, self.page_size), self.width_static)

    def _eager_buffers(self, bs: int, width: int) -> _Buffers:
        """The eager batches' page table (at least ``bs`` x ``width``), offsets, lengths and query offsets, kept from
        step to step: an eager step allocates nothing."""
        buf = self._eager
        if buf is None or buf.max_bs < bs or buf.width < width:
            rows = _pow2(max(bs, 0 if buf is None else buf.max_bs))
            # power-of-two widths keep the page-table kernel's constexpr row stride stable
            cols = max(width, min(_pow2(max(width, 0 if buf is None else buf.width)), self.width_static))
            i32 = dict(dtype=INDEX_DTYPE, device=self.device)
            buf = self._eager = _Buffers(max_bs=rows, width=cols, page_table=torch.zeros(rows, cols, **i32),
                                         kv_indptr=torch.arange(rows + 1, **i32) * cols,
                                         kv_lens=torch.ones(rows, **i32))
        return buf

    def _build_metadata(self, forward_batch) -> Optional[DecodeForwardMetadata]:
        start = time.perf_counter()
        with host_range("sglang.build_decode"):
            meta = self._decode_metadata(forward_batch)
        self._stats["metadata_host_s"] += time.perf_counter() - start
        self._count(_step_kind(forward_batch))
        return meta

    def _decode_metadata(self, forward_batch) -> Optional[DecodeForwardMetadata]:
        bs = int(forward_batch.batch_size)
        verify = forward_batch.forward_mode.is_target_verify()
        n_draft = self._verify_q_len(forward_batch) if verify else 0
        q_len = max(1, n_draft)
        if bs == 0:
            return None
        req_pool_indices = forward_batch.req_pool_indices[:bs]
        seq_lens = forward_batch.seq_lens[:bs]
        g = self._graph
        fits_graph = self._fits_graph(bs)
        if fits_graph:
            built = g.decode.get((q_len, bs))
            if built is not None:
                refill_decode_buffers(self.req_to_token, req_pool_indices, seq_lens, self.page_size, g.kv_lens,
                                      g.page_table, num_draft_tokens=n_draft, fill=self._fill)
                self._planner(q_len, bs).plan(built.metadata.kv_lens)  # refills built.metadata.plan in place
                return built
            md = sglang_decode_metadata(
                self.req_to_token, req_pool_indices, seq_lens, self.page_size, num_draft_tokens=n_draft,
                page_table=g.page_table, kv_indptr=g.kv_indptr, kv_lens=g.kv_lens,
                qo_indptr=self._qo_indptr(g, q_len), fill=self._fill)
        else:
            width = self._eager_width(forward_batch, bs, n_draft)
            e = self._eager_buffers(bs, width)
            md = sglang_decode_metadata(
                self.req_to_token, req_pool_indices, seq_lens, self.page_size, num_draft_tokens=n_draft,
                width=width, page_table=e.page_table, kv_indptr=e.kv_indptr, kv_lens=e.kv_lens,
                qo_indptr=self._qo_indptr(e, q_len), fill=self._fill)
        md.plan = self._planner(q_len, bs).plan(md.kv_lens)
        built = DecodeForwardMetadata(md, q_len, bs, _indptr_of(md), md.qo_indptr)
        if fits_graph:
            g.decode[(q_len, bs)] = built
        return built

    # ------------------------------------------------------------------ forward
    def _save_kv(self, layer, forward_batch, k, v, k_rope, save_kv_cache: bool):
        if not save_kv_cache or k is None:
            return
        loc = forward_batch.out_cache_loc
        if k_rope is not None:  # split form: k is the latent k_nope
            self.token_to_kv_pool.set_mla_kv_buffer(
                layer, loc, _as3d(k, 1, KV_LORA_RANK), _as3d(k_rope, 1, ROPE_DIM))
        else:  # concatenated form: k [T, 1, 576], v [T, 1, 512]
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)

    def _attend(self, q, q_rope, layer, forward_batch) -> torch.Tensor:
        with host_range("sglang.forward_decode"):
            meta = self.forward_metadata
            if not isinstance(meta, DecodeForwardMetadata):
                raise RuntimeError(f"{BACKEND_NAME}: {forward_batch.forward_mode} forward without decode metadata "
                                   "(init_forward_metadata was not called for this batch)")
            heads = layer.tp_q_head_num
            if q_rope is not None:
                q_nope, q_pe = _as3d(q, heads, KV_LORA_RANK), _as3d(q_rope, heads, ROPE_DIM)
            else:
                q = _as3d(q, heads, HEAD_DIM)
                q_nope, q_pe = q[..., :KV_LORA_RANK], q[..., KV_LORA_RANK:]
            kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).view(-1, self.page_size, HEAD_DIM)
            launch = self._launchers.get(layer.layer_id) or self._build_launcher(layer)
            return launch(q_nope, q_pe, kv_cache, meta.metadata).view(-1, heads * KV_LORA_RANK)

    def _build_launcher(self, layer) -> MLADecodeLauncher:
        heads = layer.tp_q_head_num
        if heads != self.num_heads:
            raise RuntimeError(f"{BACKEND_NAME}: layer has {heads} query heads, the backend was built for "
                               f"{self.num_heads} (decode attention-TP changes are not supported)")
        # SGLang stores fp8 KV with a plain cast (no scale); the op dequantises with k_scale
        # (FlashMLA's convention: layer.k_scale, or 1.0 when the checkpoint has none; the op requires one for fp8).
        k_scale = None
        if self.is_fp8_kvcache:
            k_scale = 1.0 if getattr(layer, "k_scale", None) is None else layer.k_scale
        launch = self._launchers[layer.layer_id] = MLADecodeLauncher(
            self.device, heads, page_size=self.page_size, dtype=self.q_data_type, kv_dtype=self.kv_cache_dtype,
            softmax_scale=layer.scaling, k_scale=k_scale, q_lens=self.config.q_lens, impl=self.impl,
            fp8_compute=self.config.fp8_compute)
        return launch

    def init_mha_chunk_metadata(self, forward_batch, *args, **kwargs):
        """DeepSeek's chunked-prefix MHA (prefill over a long cached prefix, FlashInfer prefill only) plans here."""
        if not hasattr(self.extend_backend, "init_mha_chunk_metadata"):
            _refuse(f"chunked-prefix MHA needs the FlashInfer prefill backend; this one prefills with "
                    f"{self.prefill_backend_name} ({ENV_PREFILL})")
        return self.extend_backend.init_mha_chunk_metadata(forward_batch, *args, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None,
                       k_rope=None, **kwargs):
        self._save_kv(layer, forward_batch, k, v, k_rope, save_kv_cache)
        return self._attend(q, q_rope, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, q_rope=None,
                       k_rope=None, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            self._save_kv(layer, forward_batch, k, v, k_rope, save_kv_cache)
            return self._attend(q, q_rope, layer, forward_batch)
        if self.prefill_backend_name == "flashinfer":  # takes the split absorbed form itself
            return self.extend_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope,
                                                      k_rope=k_rope)
        if q_rope is not None:
            # Split absorbed form (only when this name is in DeepSeek's FORWARD_ABSORB list): the
            # Triton backend takes the concatenated one, which the model would otherwise build.
            heads = layer.tp_q_head_num
            q = torch.cat([_as3d(q, heads, KV_LORA_RANK), _as3d(q_rope, heads, ROPE_DIM)], dim=-1)
            if k is not None:
                k_nope = _as3d(k, 1, KV_LORA_RANK)
                k, v = torch.cat([k_nope, _as3d(k_rope, 1, ROPE_DIM)], dim=-1), k_nope
        extra = {name: kwargs[name] for name in ("sinks", "score_mod", "aux_tensors") if kwargs.get(name) is not None}
        return self.extend_backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **extra)


def _indptr_of(md: MLADecodeMetadata) -> torch.Tensor:
    """``kv_indptr`` [bs + 1] of a row-strided table (``page_table_start`` is its first bs entries)."""
    bs = md.batch_size
    start = md.page_table_start
    if bs == 0:
        return start.new_zeros(1)
    # start is kv_indptr[:-1] of a contiguous [bs + 1] view: re-expose the full view.
    return start.as_strided((bs + 1,), (1,))


def _as3d(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """``[T, rows, dim]`` view of a ``[T, rows, dim]`` or ``[T, rows * dim]`` tensor (copies only if it must)."""
    if t.dim() == 3 and t.shape[1] == rows and t.shape[2] == dim:
        return t
    return t.reshape(-1, rows, dim)
