"""SGLang plugin: registers the TileLang MLA decode op as the attention backend ``tilelang_mla``.

Entry point (``pyproject.toml``)::

    [project.entry-points."sglang.srt.plugins"]
    mla_backend = "mla_backend.sglang_plugin:register"

SGLang (>= 0.5.17) runs every ``sglang.srt.plugins`` entry point in each of its processes
(``load_plugins()`` in ``launch_server``, ``sglang serve``, ``Engine.__init__`` and the scheduler
subprocesses), so after ``pip install`` the name works everywhere::

    python -m sglang.launch_server --model-path ... --attention-backend tilelang_mla --page-size 64

Importing this module is cheap: no sglang, tilelang or CUDA import happens until :func:`register`
runs, and :func:`register` itself only touches SGLang's registries (no CUDA, no kernel compile).
The backend (``backend.py``) is imported when SGLang builds it in the scheduler process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

logger = logging.getLogger("mla_backend.sglang")

BACKEND_NAME = "tilelang_mla"
ENV_REPORT = "MLA_BACKEND_SGLANG_REPORT"  # directory: per-process JSON with config + step counters
#: Which SGLang backend serves prefill / extend inside ``tilelang_mla``: auto (default), flashinfer or triton.
ENV_PREFILL = "MLA_BACKEND_SGLANG_PREFILL"
PREFILL_BACKENDS = ("flashinfer", "triton")
_DEEPSEEK_HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"

_registered = False
_deepseek_handler_registered = False
#: The prefill backend this process's ``tilelang_mla`` backends hold (set when one is built; the DeepSeek dispatch
#: follows it).
_prefill_in_use: str | None = None

__all__ = ["BACKEND_NAME", "ENV_PREFILL", "create_backend", "deepseek_attention_handler", "prefill_backend", "register"]


def register() -> None:
    """``sglang.srt.plugins`` entry point: make ``tilelang_mla`` a valid attention backend.

    * ``register_attention_backend("tilelang_mla")(create_backend)`` in
      ``sglang.srt.layers.attention.attention_registry`` (what ``ModelRunner`` looks up);
    * ``add_attention_backend_choices(["tilelang_mla"])`` in ``sglang.srt.server_args`` (the
      argparse ``choices`` list shared by ``--attention-backend``, ``--decode-attention-backend``
      and ``--prefill-attention-backend`` in 0.5.17; it is not added to the speculative *draft*
      choices of later releases: SGLang's draft-backend factory has no entry for out-of-tree names);
    * a DeepSeek-V2/V3 dispatch handler (see :func:`deepseek_attention_handler`), registered now if
      the DeepSeek model code is already imported, else when the backend is built.

    Idempotent; safe to call from any process.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.layers.attention import attention_registry

    if BACKEND_NAME not in attention_registry.ATTENTION_BACKENDS:
        attention_registry.register_attention_backend(BACKEND_NAME)(create_backend)

    from sglang.srt import server_args as sglang_server_args

    if BACKEND_NAME not in sglang_server_args.ATTENTION_BACKEND_CHOICES:
        sglang_server_args.add_attention_backend_choices([BACKEND_NAME])

    if prefill_backend() == "flashinfer":
        # long prompts' later chunks attend their cached prefix by ragged MHA over prefix chunks, as under flashmla
        chunked = getattr(sglang_server_args, "CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS", None)
        if chunked is not None and BACKEND_NAME not in chunked:
            sglang_server_args.add_chunked_prefix_cache_attention_backend(BACKEND_NAME)
    register_deepseek_handler(only_if_imported=True)
    _registered = True
    logger.debug("mla_backend: registered SGLang attention backend %r", BACKEND_NAME)


def create_backend(model_runner):
    """Factory stored in SGLang's ``ATTENTION_BACKENDS`` (called with the ``ModelRunner``)."""
    register_deepseek_handler()
    show_core_info_logs()
    from .backend import TileLangMLABackend

    return TileLangMLABackend(model_runner)


def prefill_backend() -> str:
    """The SGLang backend that serves prefill (EXTEND, MIXED, DRAFT_EXTEND) inside ``tilelang_mla``.

    ``MLA_BACKEND_SGLANG_PREFILL=flashinfer``: FlashInfer's MLA backend, which is also what ``flashmla`` prefills
    with (ragged MHA over the new tokens and over chunks of the cached prefix). ``triton``: SGLang's Triton backend.
    ``auto`` (the default): flashinfer where the package is installed and a CUDA GPU is present, else triton.
    """
    value = prefill_request()
    if value == "auto":
        import torch

        return "flashinfer" if importlib.util.find_spec("flashinfer") and torch.cuda.is_available() else "triton"
    if value not in PREFILL_BACKENDS:
        raise ValueError(f"{BACKEND_NAME}: {ENV_PREFILL}={value!r} is not supported; use auto, "
                         f"{' or '.join(PREFILL_BACKENDS)}")
    return value


def prefill_request() -> str:
    """``MLA_BACKEND_SGLANG_PREFILL`` as the user set it (normalised; ``auto`` when unset)."""
    return os.environ.get(ENV_PREFILL, "auto").strip().lower()


def prefill_in_use() -> str:
    """The prefill backend of this process's ``tilelang_mla`` backends (:func:`prefill_backend` before one exists)."""
    return _prefill_in_use or prefill_backend()


def set_prefill_in_use(name: str) -> None:
    """Called by the backend with the prefill backend it built."""
    global _prefill_in_use
    _prefill_in_use = name


def show_core_info_logs() -> None:
    """The core's INFO lines (kernels ready and in how long, the prefill backend) in SGLang's server log, unless
    the application set the ``mla_backend`` logger's level itself: SGLang's handlers print what a logger lets
    through, and a logger without a level passes warnings only."""
    core = logging.getLogger("mla_backend")
    if core.level == logging.NOTSET:
        core.setLevel(logging.INFO)


def deepseek_attention_handler(attn, forward_batch):
    """DeepSeek attention-method choice for ``tilelang_mla``: that of the prefill backend it holds.

    Decode and speculative verify take the absorbed-MLA path (``AttnForwardMethod.MLA``), which
    calls this backend with the 576-wide latent query. Prefill goes where SGLang's handler for the prefill backend
    sends it, served by that backend inside ``TileLangMLABackend``: with FlashInfer (as under ``flashmla``), ragged
    MHA over the new tokens (``MHA_ONE_SHOT``, or ``MHA_CHUNKED_KV`` over a long cached prefix); with Triton, plain
    MHA without a cached prefix and the absorbed path with one, exactly as with ``--attention-backend triton``.
    """
    module = sys.modules.get(_DEEPSEEK_HANDLER_MODULE) or importlib.import_module(_DEEPSEEK_HANDLER_MODULE)
    if prefill_in_use() == "flashinfer":
        return module.handle_attention_flashinfer(attn, forward_batch)
    return module.handle_attention_triton(attn, forward_batch)


def register_deepseek_handler(only_if_imported: bool = False) -> bool:
    """Register :func:`deepseek_attention_handler` with DeepSeek's ``AttentionBackendRegistry``.

    (SGLang 0.5.17 falls back to the "triton" handler for unknown names anyway; registering makes
    the choice explicit and independent of that fallback.) Returns True once registered.
    """
    global _deepseek_handler_registered
    if _deepseek_handler_registered:
        return True
    if only_if_imported and _DEEPSEEK_HANDLER_MODULE not in sys.modules:
        return False
    try:
        module = importlib.import_module(_DEEPSEEK_HANDLER_MODULE)
        module.AttentionBackendRegistry.register(BACKEND_NAME, deepseek_attention_handler)
    except Exception as exc:  # the model code moved: SGLang's triton fallback still applies
        logger.warning("mla_backend: could not register the DeepSeek attention handler (%s); "
                       "SGLang's default (triton) dispatch applies", exc)
        return False
    _deepseek_handler_registered = True
    return True
