"""Sustained clock, power and cycles per call of ours and vLLM's anchors on the same inputs (GPU machine).

Why: the h=128 decodes run power-capped, so a time ratio mixes work per cycle with cycles per second. Each
implementation is launched back to back for ``--seconds`` (no L2 flush: a sustained load, as in serving) while a
thread samples NVML (SM clock, power, throttle reasons) every 10 ms; cycles per call = µs x mean MHz.

    python3 scripts/anchor_probe.py --shapes "128,16384,128,1,64;64,8192,128,2,64" --impls ours,fa3,flashmla
    ncu --profile-from-start off ... python3 scripts/anchor_probe.py --shapes ... --impls fa3 --ncu
``--ncu``: two warm-up calls, then one call between cudaProfilerStart / Stop, no timing."""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from mla_backend.bench import Case, Config, KVGroup, Skip, flops, load_anchors, make_runner


class Sampler(threading.Thread):
    """NVML samples (MHz, W, throttle-reason bits) until stopped; empty if NVML cannot be loaded."""

    def __init__(self, period_s: float = 0.01):
        super().__init__(daemon=True)
        self.period_s, self.samples, self._halt = period_s, [], threading.Event()
        try:
            try:
                import pynvml
            except ImportError:
                from vllm.third_party import pynvml  # vLLM ships a copy

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as e:  # noqa: BLE001 - report the timing without clocks
            print(f"no NVML ({type(e).__name__}: {e}): clocks not sampled")
            self.nvml = None

    def run(self):
        nv = self.nvml
        while nv and not self._halt.is_set():
            self.samples.append((nv.nvmlDeviceGetClockInfo(self.handle, nv.NVML_CLOCK_SM),
                                 nv.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                                 nv.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle)))
            time.sleep(self.period_s)

    def stop(self) -> dict:
        self._halt.set()
        self.join()
        s = self.samples[len(self.samples) // 5:]  # drop the ramp
        if not s:
            return {}
        return {"mhz": statistics.mean(x[0] for x in s), "watts": statistics.mean(x[1] for x in s),
                "capped": sum(1 for x in s if x[2] & 0x4) / len(s), "n": len(s)}


def sustained(fn, seconds: float) -> dict:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.3:  # settle the clock before measuring
        fn()
        n += 1
    torch.cuda.synchronize()
    sampler = Sampler()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sampler.start()
    calls, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        if calls % 100 == 0:
            torch.cuda.synchronize()  # keep the host at most 100 calls ahead
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / calls
    clk = sampler.stop()
    return {"us": us, "calls": calls, **clk}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="128,16384,128,1,64;64,8192,128,2,64;128,16384,16,1,64",
                    help="b,s_k,h,s_q,page;... (fixed lengths)")
    ap.add_argument("--impls", default="ours,fa3,flashmla")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    impls = args.impls.split(",")
    anchors = load_anchors(set(impls) - {"ours"})
    for name, mod in anchors.items():
        if isinstance(mod, str):
            print(f"skip {name}: {mod}")
    for spec in args.shapes.split(";"):
        b, s_k, h, s_q, page = (int(x) for x in spec.split(","))
        cfg = Config(b, s_k, h, s_q, False, page)
        case = Case(cfg, KVGroup(cfg, 0, dev, False), 0, dev)
        flop = flops(case.kvg.sum_len, s_q, h)
        rows = {}
        for name in impls:
            try:
                fn = make_runner(name, case, anchors, graphs=False)
            except Skip as e:
                print(f"{cfg.label()} {name}: skip ({e})")
                continue
            if args.ncu:
                fn(), fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                fn()
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
                continue
            r = rows[name] = sustained(fn, args.seconds)
            tf = flop / r["us"] / 1e6
            mhz = r.get("mhz")
            extra = (f"  {mhz:6.0f} MHz  {r['watts']:5.0f} W  capped {100 * r['capped']:3.0f}%  "
                     f"{r['us'] * mhz / 1e3:8.0f} kcycles" if mhz else "")
            print(f"{cfg.label()} {name:9s} {r['us']:8.1f} us  {tf:6.1f} TF/s  ({r['calls']} calls){extra}",
                  flush=True)
        if "ours" in rows and rows["ours"].get("mhz"):
            o = rows["ours"]
            for name, r in rows.items():
                if name != "ours" and r.get("mhz"):
                    print(f"  ours / {name}: time {o['us'] / r['us']:.3f}, cycles "
                          f"{o['us'] * o['mhz'] / (r['us'] * r['mhz']):.3f}, clock {o['mhz'] / r['mhz']:.3f}")
        del case
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
