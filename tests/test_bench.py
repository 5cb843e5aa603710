"""The decode benchmark on CPU: what ``--fp8`` adds, which cache each impl reads, the mixed-batch configs."""

from __future__ import annotations

import dataclasses

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


def test_mixed_grid_is_short_ragged_requests_and_one_long_one():
    every = bench.make_configs("mixed")
    assert {(c.b, c.long_len) for c in every} == {(64, 0), (65, 16384)}
    cfgs = [c for c in every if c.long_len]
    assert {(c.h, c.s_q) for c in cfgs} == {(16, 1), (16, 2), (128, 1), (128, 2)}
    lens = bench.seq_lens(cfgs[0])
    assert len(lens) == 65 and lens[-1] == 16384 and max(lens[:-1]) <= 2048 and len(set(lens[:-1])) > 10
    assert cfgs[0].label().endswith("ragged +1x16384 p64")
    # its own KV group (the long request changes the cache), and the filter finds it by kind and by long_len
    assert cfgs[0].kv_key() != dataclasses.replace(cfgs[0], long_len=0).kv_key()
    full = bench.make_configs("full")
    assert bench.select(full, ["kind=mixed"]) == every and bench.select(full, ["long_len=16384"]) == cfgs
