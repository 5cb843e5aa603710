"""scripts/trace_blocks.py on CPU: a traced record is summarised for long programs and for short ones (a batch of
short requests, where segment starts show in each block's WG0 period, and the fp8-compute kernel's segment stamps are
read), and its shapes parse with their flags."""

import os
import sys

import pytest

from mla_backend.kernels.sm90.protocol import SEG_TRACE_STEP, TRACE_BLOCKS, TRACE_HEAD, TRACE_STEPS, TRACE_WORDS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "scripts"))
import trace_blocks  # noqa: E402


def word(role: int, g: int, step: int) -> int:
    return (role * TRACE_BLOCKS + g) * TRACE_STEPS + step


def record(blocks: int, period: int = 1000, segment_starts=(), segment_cost: int = 5000,
           steps: dict = trace_blocks.STEPS) -> list:
    """A synthetic trace: every role's steps 100 cycles apart, a block every ``period`` cycles, ``segment_cost`` more
    before each block in ``segment_starts``."""
    words = [0] * TRACE_WORDS
    start = 10_000
    for g in range(blocks):
        start += segment_cost if g in segment_starts else 0
        for role, names in steps.items():
            for step in range(len(names) + 1):
                words[word(role, g, step)] = start + 100 * step
        start += period
    for role in range(3):
        words[TRACE_HEAD + role * 4:TRACE_HEAD + role * 4 + 4] = [10_000, 1_000, start, 1_000 + start // 2]
    return words


def test_a_long_program_is_summarised_over_its_steady_blocks():
    text = trace_blocks.summarise(record(64), "128,16384,128,1,64", 900.0)
    assert "blocks traced" not in text and "no trace" not in text
    assert "period 1000" in text and "per block" not in text


def test_a_short_program_shows_each_block_and_its_segment_starts():
    text = trace_blocks.summarise(record(20, segment_starts=(9,)), "65,1024,128,1,64,ragged,long=16384", 90.0)
    assert "(20 blocks traced)" in text and "no trace" not in text
    per_block = text.split("WG0 per block (period / k wait): ")[1]
    assert "8: 6000/100" in per_block and "7: 1000/100" in per_block  # block 9 starts a segment 5000 cycles late
    assert "no trace" in trace_blocks.summarise(record(3), "1,128,128,1,64", 10.0)


def test_fp8c_segment_stamps_give_each_segments_start_and_end():
    """Three segments (blocks 0-8, 9-14, 15-19), 5000 cycles between them. At each segment's first block: WG0 stamps
    700 cycles before its first S (its wait for Q8), the producer 3000 / 2000 / 1200 before it (q_free wait 1000,
    quantisation 800); WG1 stamps 400 after its last P V's end (step 3 at +300)."""
    starts, blocks = (0, 9, 15), 20
    words = record(blocks, segment_starts=starts[1:], steps=trace_blocks.FP8C_STEPS)
    ends = [*starts[1:], blocks]
    for g0, end in zip(starts, ends):
        first_s = words[word(0, g0, 0)]
        words[word(0, g0, SEG_TRACE_STEP)] = first_s - 700
        for step, before in ((SEG_TRACE_STEP - 2, 3000), (SEG_TRACE_STEP - 1, 2000), (SEG_TRACE_STEP, 1200)):
            words[word(2, g0, step)] = first_s - before
        words[word(1, g0, SEG_TRACE_STEP)] = words[word(1, end - 1, 3)] + 400
    text = trace_blocks.summarise(words, "64,1024,128,1,64,ragged", 70.0, trace_blocks.FP8C_STEPS)
    assert "segments: 3 (first blocks [0, 9, 15])" in text
    first, second = [line for line in text.splitlines() if line.lstrip().startswith("segment g=")][:2]
    assert first.startswith("  segment g=0..8: WG0 waits for Q8 700;") and "previous epilogue" not in first
    assert "q_free wait 1000, Q8 quantised in 800 (ready 1200 before WG0's S)" in first
    # WG1: its l 400 after its last P V; its epilogue until block 9's first stamp (6000 after block 8's, less 700)
    assert "WG1: waits 400 for WG0's l, then its epilogue 5300" in first
    # WG0's previous epilogue: from block 8's P V end (+600) to its stamp 700 before block 9's first S (+6000)
    assert second.startswith("  segment g=9..14: WG0 waits for Q8 700; after its previous epilogue of 4700;")
    assert "segments:" not in trace_blocks.summarise(record(20), "64,1024,128,1,64,ragged", 70.0)


def test_shapes_take_ragged_and_a_long_request():
    """trace_blocks reads its --shapes with quick_time's parser, which takes the mixed batch's long request."""
    from quick_time import parse_shapes, shape_flags

    [(dims, opts)] = parse_shapes("65,1024,128,1,64,ragged,long=16384")
    assert dims == (65, 1024, 128, 1, 64) and opts == {"fp8": False, "ragged": True, "seq": False, "long_len": 16384}
    assert shape_flags(opts) == " ragged long=16384"
    assert parse_shapes("128,16384,128,2,64") == [((128, 16384, 128, 2, 64), {"fp8": False, "ragged": False,
                                                                               "seq": False, "long_len": 0})]
    with pytest.raises(SystemExit, match=r"unknown flag\(s\) \['fp16'\]"):
        parse_shapes("1,128,16,1,64,fp16")
