"""GPU machine: A/B of environment settings in one process, rounds interleaved so clock drift hits both alike.

Each setting's decode step (quick_time.decode_step: fixed lengths, random page order) is captured under its env,
then per round and setting: the bench's timing (256 MB L2 flush + spin before each replay, median), back-to-back
replays (mean) and the bench's timing of the eager call (under the setting's env: the bench's default mode). Prints
the median over rounds.
    PYTHONPATH=$PWD:scripts python3 scripts/ab_interleave.py "64,8192,128,2,64;..." "a:" "b:NAME=VALUE" ...
A setting is ``label:NAME=VALUE,...`` (no pairs: the environment as it is; two such give the noise floor).
"""
import os
import statistics
import sys
from unittest import mock

import torch

from mla_backend.bench import Timer
from quick_time import decode_step, parse_shapes, shape_flags


def back_to_back(replay, n: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main() -> int:
    shapes = parse_shapes(sys.argv[1])
    settings = [(s.split(":", 1)[0], dict(kv.split("=", 1) for kv in s.split(":", 1)[1].split(",") if kv))
                for s in sys.argv[2:]]
    rounds = int(os.environ.get("AB_ROUNDS", "4"))
    timer = Timer("cuda", reps=(30, 30))
    for (b, s, h, sq, ps), opts in shapes:
        steps = {}
        for name, env in settings:
            with mock.patch.dict(os.environ, env):
                steps[name] = decode_step(b, s, h, sq, ps, **opts)  # keeps the inputs the graph reads alive
        flops = steps[settings[0][0]][2][1]
        res = {name: ([], [], []) for name, _ in settings}
        for _ in range(rounds):
            for name, env in settings:
                replay, eager = steps[name][:2]
                res[name][0].append(timer(replay, reps=30)["us"])
                res[name][1].append(back_to_back(replay))
                with mock.patch.dict(os.environ, env):  # the spin covers the measured host cost, as in the bench
                    res[name][2].append(timer(eager, reps=30, host_us=Timer.host_us(eager))["us"])
        cells = " | ".join(f"{name} flushed {statistics.median(f):7.1f} us ({flops / statistics.median(f) / 1e6:5.1f} TF)"
                           f" b2b {statistics.median(bb):7.1f} eager {statistics.median(e):7.1f}"
                           for name, (f, bb, e) in res.items())
        print(f"b={b} s={s} h={h} s_q={sq} page={ps}{shape_flags(opts)}: "
              f"{cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
