"""The README's Python examples, run as written: on a CPU machine through the reference path, on a GPU through the
kernels (the example picks the device itself)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run_as_written(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2, "the README's op example and launcher example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # later blocks continue the first one's session
    assert "torch.Size([2, 16, 512]) torch.Size([2, 16])" in capsys.readouterr().out
    out, md, q, kv_cache = namespace["out"], namespace["md"], namespace["q"], namespace["kv_cache"]
    # the launcher's output (the last block) is the op's on the same inputs
    expected = namespace["mla_decode"](q, kv_cache, md, softmax_scale=192 ** -0.5, impl="reference")
    assert out.shape == (2, 16, 512) and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
