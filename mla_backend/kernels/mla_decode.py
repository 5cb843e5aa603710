"""The portable kernel's former module name: ``portable`` (the split kernel) and ``combine`` (the merges)."""

from .combine import build_combine_kernel, build_tiled_combine_kernel, tiled_combine_chunks  # noqa: F401
from .portable import build_decode_kernel  # noqa: F401
