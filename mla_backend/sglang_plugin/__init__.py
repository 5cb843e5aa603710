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
import logging
import sys

logger = logging.getLogger("mla_backend.sglang")

BACKEND_NAME = "tilelang_mla"
ENV_REPORT = "MLA_BACKEND_SGLANG_REPORT"  # directory: per-process JSON with config + step counters
_DEEPSEEK_HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"

_registered = False
_deepseek_handler_registered = False

__all__ = ["BACKEND_NAME", "create_backend", "deepseek_attention_handler", "register"]


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

    register_deepseek_handler(only_if_imported=True)
    _registered = True
    logger.debug("mla_backend: registered SGLang attention backend %r", BACKEND_NAME)


def create_backend(model_runner):
    """Factory stored in SGLang's ``ATTENTION_BACKENDS`` (called with the ``ModelRunner``)."""
    register_deepseek_handler()
    from .backend import TileLangMLABackend

    return TileLangMLABackend(model_runner)


def deepseek_attention_handler(attn, forward_batch):
    """DeepSeek attention-method choice for ``tilelang_mla``: the same as SGLang's Triton handler.

    Decode and speculative verify take the absorbed-MLA path (``AttnForwardMethod.MLA``), which
    calls this backend with the 576-wide latent query. Prefill without a cached prefix takes
    ``AttnForwardMethod.MHA`` (plain 192/128-dim MHA over the new tokens; the model writes the
    latent KV itself) and prefill with a prefix the absorbed path; both are served by the Triton
    backend held inside ``TileLangMLABackend``, exactly as with ``--attention-backend triton``.
    """
    module = sys.modules.get(_DEEPSEEK_HANDLER_MODULE) or importlib.import_module(_DEEPSEEK_HANDLER_MODULE)
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
