"""Make SGLang's Python package importable next to a CPU-only torch (CI; no effect on a CUDA install).

``import sglang`` reaches ``torchvision`` (``sglang.srt.configs`` -> ``torchvision.transforms``, and
transformers' image utilities). For Linux, PyPI ships only torchvision's CUDA build; with
torch 2.13.0+cpu its C extension (``torchvision/_C.so``) cannot load (it links ``libc10_cuda.so``).
torchvision then still imports, except that ``torchvision/_meta_registrations.py`` registers fake
(meta) kernels for ``torchvision::nms`` and ``torchvision::qnms`` without checking that the extension
defined them, and that raises ``RuntimeError: operator torchvision::nms does not exist``.

:func:`prepare_cpu_torchvision` loads the extension the way torchvision does; only if that fails, it
defines those two operator schemas (torchvision's own signatures, no kernels), so the import goes
through. Nothing here touches SGLang, and no torchvision op can run afterwards (none is needed).
"""

from __future__ import annotations

import importlib.util
import os

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIB = None  # keeps the schema fragment registered


def prepare_cpu_torchvision() -> str:
    """Returns "absent", "native" (torchvision's extension loads) or "schemas" (defined here)."""
    global _LIB
    if _LIB is not None:
        return "schemas"
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return "absent"
    import torch

    pkg = list(spec.submodule_search_locations)[0]
    libs = sorted(f for f in os.listdir(pkg) if f.startswith("_C.") and f.endswith((".so", ".pyd")))
    try:
        if not libs:
            raise OSError("no torchvision/_C extension")
        torch.ops.load_library(os.path.join(pkg, libs[0]))
        return "native"
    except OSError:
        pass
    if hasattr(torch.ops.torchvision, "nms"):  # defined by someone else already
        return "native"
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIB = lib
    return "schemas"
