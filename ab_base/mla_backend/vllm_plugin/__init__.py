"""vLLM plugin: registers the TileLang MLA decode backend as vLLM's ``CUSTOM`` attention backend.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point (declared in
``pyproject.toml`` as ``mla_backend = "mla_backend.vllm_plugin:register"``) in every process it
starts: the front end, the engine core and each worker. Select the backend with
``vllm serve ... --attention-backend CUSTOM`` or ``LLM(..., attention_backend="CUSTOM")``.

This module imports nothing heavy: registration stores a class path string, and vLLM imports
:mod:`mla_backend.vllm_plugin.backend` only when a model actually selects ``CUSTOM``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.mla_backend")  # under vLLM's logger: its handler and level

#: Entry-point name (what ``VLLM_PLUGINS=...`` filters on).
PLUGIN_NAME = "mla_backend"
#: Class vLLM resolves ``AttentionBackendEnum.CUSTOM`` to.
BACKEND_CLASS_PATH = "mla_backend.vllm_plugin.backend.TileLangMLABackend"
#: vLLM releases this plugin was written and tested against, GPU end to end included (others get a
#: warning, not an error).
TESTED_VLLM_VERSIONS = ("0.26.",)
#: Releases where only the CPU tests (tests/test_vllm_plugin.py: registration, capability checks, vLLM's
#: metadata builder, forward_mqa on the reference path) were run: 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0,
#: 0.32.0, 0.33.0. They get a milder warning.
CPU_CHECKED_VLLM_VERSIONS = ("0.27.", "0.28.", "0.29.", "0.30.", "0.31.", "0.32.", "0.33.")

_warned_version = False


def register() -> None:
    """Register :data:`BACKEND_CLASS_PATH` as ``AttentionBackendEnum.CUSTOM``.

    Cheap (no CUDA initialisation, no kernel compilation, no import of the op or the kernels) and
    idempotent: vLLM may call it several times in one process and once in every process. If another
    plugin already claimed ``CUSTOM``, that registration is kept and a warning says how to choose
    (``VLLM_PLUGINS``); the first registration in a process wins.
    """
    global _warned_version
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden():
        current = custom.get_path()
        if current != BACKEND_CLASS_PATH:
            logger.warning(
                "mla_backend: AttentionBackendEnum.CUSTOM is already registered to %s; not replacing it with %s. "
                "Set VLLM_PLUGINS=%s to load only this plugin.", current, BACKEND_CLASS_PATH, PLUGIN_NAME)
        return
    register_backend(custom, BACKEND_CLASS_PATH)
    if not _warned_version:
        _warned_version = True
        try:
            import vllm

            version = getattr(vllm, "__version__", "unknown")
        except Exception:  # pragma: no cover - vllm is importable if we got here
            version = "unknown"
        if str(version).startswith(CPU_CHECKED_VLLM_VERSIONS):
            logger.warning("mla_backend: vLLM %s passes this plugin's CPU tests, but GPU end-to-end runs were "
                           "only done on %s; registering.", version,
                           ", ".join(v + "x" for v in TESTED_VLLM_VERSIONS))
        elif not str(version).startswith(TESTED_VLLM_VERSIONS):
            logger.warning("mla_backend: vLLM %s is untested (this plugin targets %s); registering anyway.",
                           version, ", ".join(v + "x" for v in TESTED_VLLM_VERSIONS))
    logger.debug("mla_backend: registered %s as vLLM attention backend CUSTOM", BACKEND_CLASS_PATH)


__all__ = ["BACKEND_CLASS_PATH", "PLUGIN_NAME", "register"]
