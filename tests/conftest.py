"""Shared test setup.

* Tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA GPU.
* The full lowering matrix is marked ``slow``: every test of a ``tests/test_lowering*.py`` module that lowers a
  kernel (uses a fixture named ``*lower*`` or calls ``tilelang.lower`` / a ``_lower*`` helper), and the gfx942
  builds of tests/test_hip_codegen.py (fixture ``hip_build``: 10+ minutes on 2 busy cores). Each lowering takes
  20-60 s on 2 idle cores, 2-3 minutes on busy ones; together they took ~30 of the suite's 32 minutes. pyproject's
  ``addopts`` deselects them by default (``-m 'not slow'``), so ``python3 -m pytest -q`` keeps their pure-Python
  checks (barrier protocol simulations, register budgets, prim_func scripts) and lowers only
  tests/test_tilelang_versions.py's representative variants; ``python3 -m pytest -m slow`` (.ci/run's second pass)
  or ``-m ''`` runs the rest.
* On a Hopper GPU, the kernels the selected ``gpu`` tests launch (tests/precompile.py: read off each item's
  ``mla_kernels`` marker and parameters) are compiled in parallel, one process per variant on every CPU, into
  TileLang's disk cache before the first test runs, instead of one after another as each test first needs one.
  ``MLA_BACKEND_TEST_PRECOMPILE=0`` turns that off. At the end, any kernel a test launched that was not precompiled
  is listed (a test whose marker misses a variant it builds).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import precompile

# A lowering: a fixture that lowers (lowered, lowered_tws, cuda_lowered, ...) or a call that does.
_LOWERING_CALL = re.compile(r"(?<![\w.])(?:tilelang\.lower|tilelang\.compile|_lower\w*)\(|getfixturevalue\(\s*\S*lower")


def _lowers(item) -> bool:
    if any("lower" in name or name == "hip_build" for name in getattr(item, "fixturenames", ())):
        return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return False
    return _LOWERING_CALL.search(source) is not None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        module = item.path.name
        if (module.startswith("test_lowering") or module == "test_hip_codegen.py") and _lowers(item):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    why = f"needs a CUDA GPU; torch {torch.__version__} reports none (torch.cuda.is_available() is False)"
    skip_gpu = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_PRECOMPILED = pytest.StashKey[list]()


def pytest_collection_finish(session):
    # after -m / -k selection: only the selected tests' kernels; not under --collect-only or on an xdist worker (each
    # would compile the same variants)
    config = session.config
    if config.option.collectonly or hasattr(config, "workerinput"):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    write_line = reporter.write_line if reporter is not None else print
    config.stash[_PRECOMPILED] = precompile.precompile(session.items, write_line)


def pytest_terminal_summary(terminalreporter, config):
    names = config.stash.get(_PRECOMPILED, [])
    missed = precompile.not_precompiled(names) if names else []
    if missed:
        terminalreporter.write_line(f"mla_backend: launched but not precompiled (add them to the tests' mla_kernels "
                                    f"markers): {', '.join(missed)}")
