"""The decode benchmark's impl names on CPU: what ``--fp8`` adds and which cache each impl reads."""

from __future__ import annotations

import pytest

from mla_backend import bench


def test_fp8_adds_both_of_ours_and_the_anchors_fp8_paths():
    assert bench.impl_list("ours,flashmla", fp8=False) == ["ours", "flashmla"]
    assert bench.impl_list("ours,flashmla,fa3", fp8=True) == ["ours", "flashmla", "fa3", "ours-fp8", "ours-fp8c",
                                                              "flashmla-fp8"]
    with pytest.raises(ValueError, match=r"unknown impl\(s\) \['ours-fp8c'\]"):
        bench.impl_list("ours-fp8c", fp8=True)


def test_fp8_cache_readers_and_their_implementation():
    assert [bench.fp8_kv(n) for n in ("ours", "ours-fp8", "ours-fp8c", "flashmla-fp8", "fa3")] == [
        False, True, True, True, False]
    assert [bench.base_impl(n) for n in ("ours-fp8c", "ours-fp8", "flashmla-fp8", "fa3")] == [
        "ours", "ours", "flashmla", "fa3"]
    # ours-fp8c quantises q as flashmla-fp8 does: a looser warning threshold than the exact-q fp8 path
    assert bench.tolerance("ours-fp8") < bench.tolerance("ours-fp8c") < bench.tolerance("flashmla-fp8")
