"""GPU machine: how the L2 state before a decode step changes its time (our kernel alone, CUDA-graph replay).

Per shape: back-to-back replays; each replay after a 256 MB write (dirty L2, what triton's do_bench does); after a
256 MB read (clean L2); after an idle spin. Events around the replay only, median of 30.
    PYTHONPATH=$PWD:scripts python3 scripts/flush_probe.py "64,8192,128,2,64;128,16384,16,1,64"
"""
import statistics
import sys

import torch

from quick_time import decode_step


def timed(replay, before=None, reps=30):
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main():
    buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for shape in sys.argv[1].split(";"):
        b, s, h, sq, ps = (int(v) for v in shape.split(","))
        replay, _, (nbytes, flops) = decode_step(b, s, h, sq, ps)
        for _ in range(10):
            replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(30):
            replay()
        end.record()
        torch.cuda.synchronize()
        loop = start.elapsed_time(end) * 1e3 / 30
        dirty = timed(replay, lambda: buf.zero_())
        clean = timed(replay, lambda: buf.view(torch.int32).sum())
        idle = timed(replay, lambda: torch.cuda._sleep(2_000_000))
        print(f"b={b} s={s} h={h} s_q={sq} page={ps}: back-to-back {loop:7.1f} us | after 256 MB write {dirty:7.1f} | "
              f"after 256 MB read {clean:7.1f} | after idle {idle:7.1f}  ({flops / loop / 1e6:.0f} TF back-to-back)",
              flush=True)


if __name__ == "__main__":
    main()
