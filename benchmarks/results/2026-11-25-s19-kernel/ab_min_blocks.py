import statistics, mla_backend.planner as P
from quick_time import decode_step
from mla_backend.bench import Timer
t = Timer("cuda", reps=(30, 30))
shapes = [(1, 4096, 128, 1, 64), (1, 4096, 128, 2, 64), (1, 4096, 64, 1, 64), (1, 2048, 32, 1, 64), (2, 4096, 128, 1, 64),
          (1, 8192, 128, 1, 64), (4, 2048, 64, 1, 64), (1, 4096, 16, 1, 64), (1, 4096, 16, 2, 64)]
new, base = P.min_blocks_per_part, (lambda rows: 1)
steps = {}
for name, fn in (("new", new), ("base", base)):
    P.min_blocks_per_part = fn
    for sh in shapes:
        steps[name, sh] = decode_step(*sh)
res = {k: ([], []) for k in steps}
for _ in range(5):
    for k, (replay, eager, _) in steps.items():
        res[k][0].append(t(replay, reps=30)["us"])
        res[k][1].append(t(eager, reps=30)["us"])
for sh in shapes:
    print(f"b,s,h,sq,page={sh}: " + " | ".join(f"{n} graph {statistics.median(res[n, sh][0]):6.1f} eager {statistics.median(res[n, sh][1]):6.1f}" for n in ("new", "base")), flush=True)
