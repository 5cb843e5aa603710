"""The decode benchmark on CPU: what ``--fp8`` adds, which cache each impl reads, the mixed and served configs."""

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


def test_served_grid_is_4k_prompts_decoded_from_different_steps():
    every = bench.make_configs("served")
    assert {(c.b, c.s_k, c.h, c.s_q) for c in every} == {(b, 4096, h, sq) for b in (16, 64) for h in (64, 128)
                                                       for sq in (1, 2)}
    cfg = next(c for c in every if c.b == 64)
    lens = bench.seq_lens(cfg)
    assert len(lens) == 64 and 4096 <= min(lens) and max(lens) < 4096 + bench.SERVED_SPREAD and len(set(lens)) > 30
    assert lens == bench.seq_lens(cfg) and lens != bench.seq_lens(cfg, seed=1)  # seeded
    assert cfg.label() == f"b=64 s_k=4096 h={cfg.h} s_q={cfg.s_q} spread{bench.SERVED_SPREAD} p64"
    # its own KV group (not the grid's ragged 4k cache), and the filter finds it by kind, lens and spread
    assert cfg.kv_key() != dataclasses.replace(cfg, spread=0).kv_key()
    full = bench.make_configs("full")
    assert bench.select(full, ["kind=served"]) == every == bench.select(full, [f"spread={bench.SERVED_SPREAD}"])
    assert bench.select(full, [f"lens=spread{bench.SERVED_SPREAD},b=16"]) == [c for c in every if c.b == 16]
