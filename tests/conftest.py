"""Shared test setup: tests marked ``gpu`` are skipped, with the reason, where torch sees no CUDA GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    why = f"needs a CUDA GPU; torch {torch.__version__} reports none (torch.cuda.is_available() is False)"
    skip_gpu = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
