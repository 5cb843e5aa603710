"""Helpers of the CPU-side checks of the lowered kernels: locating the CUDA compiler, reading the CUDA source."""

from __future__ import annotations

import os
import shutil

import pytest


def find_nvcc() -> str:
    """nvcc from PATH, CUDA_HOME or /usr/local/cuda; skips the calling test when there is none."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
            if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
                return os.path.join(home, "bin", "nvcc")
        pytest.skip("nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the CUDA sources are not compiled")
    return nvcc


def kernel_body(src: str) -> str:
    """A lowered kernel's CUDA body, from the opening brace of its definition."""
    return src[src.index("{", src.index("__global__ void __launch_bounds__")):]
