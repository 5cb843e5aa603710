"""``mla-backend bench``'s outputs: the environment of a run, the console table, the markdown report, the plot, and
the JSON / CSV / markdown / PNG files (``save``). The records are ``bench.run``'s: per config its label, lengths,
bytes and FLOP, plan time and per implementation its median µs, GB/s, TFLOP/s and SM clock.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import subprocess
import sys

import torch

from . import installed


def environment(argv: list[str]) -> dict:
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": "mla-backend bench " + " ".join(argv), "python": sys.version.split()[0],
           "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    env.update({pkg: installed.version(pkg) for pkg in ("triton", "vllm", "tilelang", "sglang-kernel")})
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gib=round(p.total_memory / 2**30, 1))
    from .kernels.configs import config_for

    env["sm90_kernel"] = config_for("sm90").kernel  # the Hopper kernel's name in the records
    for k, cmd in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                   ("git", ["git", "-C", os.path.dirname(__file__), "describe", "--always", "--dirty"])):
        try:
            env[k] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.split()[0]
        except Exception:  # noqa: BLE001
            env[k] = None
    return env


def table(results: list[dict], impls: list[str]) -> list[str]:
    """Config, then per impl median us / GB/s / TFLOP/s, then ours / best (FlashMLA, FA3)."""
    cell = lambda v: f"{v['us']:9.1f}{v['gbps']:6.0f}{v['tflops']:7.1f}" if v and "us" in v else f"{'-':^22}"  # noqa: E731
    lines = [f"{'':<38}" + "".join(f"{n:>22}" for n in impls) + f"{'ours /':>10}",
             f"{'config':<38}" + f"{'us':>9}{'GB/s':>6}{'TF/s':>7}" * len(impls) + f"{'best':>10}"]
    lines.append("-" * len(lines[0]))
    for r in results:
        ratio = f"{r['ratio']:10.2f}" if r["ratio"] else f"{'-':>10}"
        lines.append(f"{r['label']:<38}" + "".join(cell(r["impls"].get(n)) for n in impls) + ratio)
    return lines


def markdown(results: list[dict], impls: list[str], env: dict, settings: dict) -> str:
    us = lambda r, n: f"{r['impls'][n]['us']:.1f}" if "us" in r["impls"].get(n, {}) else "–"  # noqa: E731
    lines = [f"### MLA decode on {env.get('gpu')} ({env['date'][:10]})", "",
             f"torch {env['torch']} (CUDA {env['cuda_runtime']}), triton {env['triton']}, vLLM {env['vllm']}, "
             f"tilelang {env['tilelang']} (Hopper kernel `{env.get('sm90_kernel')}`), "
             + (f"sgl-kernel {env['sglang-kernel']}, " if env.get("sglang-kernel") else "")
             + f"driver {env.get('driver')}, "
             f"commit {env.get('git')}. "
             f"{settings['timing']}. Command: `{env['command']}`", "",
             "| config | " + " | ".join(f"{n} µs" for n in impls) + " | ours GB/s | ours TFLOP/s | plan µs | ours / best |",
             "|---" * (len(impls) + 5) + "|"]
    for r in results:
        o = r["impls"].get("ours", {})
        lines.append(f"| {r['label']} | " + " | ".join(us(r, n) for n in impls)
                     + (f" | {o['gbps']:.0f} | {o['tflops']:.1f}" if "us" in o else " | – | –")
                     + f" | {r['plan_us']:.1f} | " + (f"{r['ratio']:.2f}" if r["ratio"] else "–") + " |")
    lines += ["", "ours / best = our time / min(FlashMLA, FlashMLA (sgl-kernel), FA3) time (below 1: ours is faster). "
              "GB/s = (Σlen·576·kv_bytes + b·s_q·h·1088·2) / t; TFLOP/s = 2·s_q·Σlen·h·1088 / t."]
    clocks = clock_summary(results, impls)
    return "\n".join(lines + ([clocks] if clocks else [])) + "\n"


def clock_summary(results: list[dict], impls: list[str]) -> str | None:
    """One line: each impl's SM clock while it was timed (NVML), lowest to highest over the configs; None without
    samples."""
    spans = []
    for n in impls:
        mhz = [r["impls"][n]["sm_mhz"] for r in results if r["impls"].get(n, {}).get("sm_mhz")]
        if mhz:
            spans.append(f"{n} {min(mhz):.0f}" + (f"-{max(mhz):.0f}" if max(mhz) != min(mhz) else ""))
    return ("SM clock while timed (NVML samples, median per config), MHz: " + ", ".join(spans) + ".") if spans else None


def plot_results(results: list[dict], impls: list[str], path: str, title: str = "") -> bool:
    """GB/s per impl and ours / best per config; False (and no file) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x = list(range(len(results)))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(8, 0.28 * len(x)), 8), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1]})
    for n in impls:
        ys = [r["impls"].get(n, {}).get("gbps", float("nan")) for r in results]
        if any(y == y for y in ys):  # not all NaN
            ax.plot(x, ys, marker="o", ms=3, lw=1, label=n)
    ax.set(ylabel="GB/s (KV + q + out bytes / time)", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.bar(x, [r["ratio"] or float("nan") for r in results])
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel("ours / best")
    ax2.set_xticks(x, [r["label"] for r in results], rotation=90, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def save(out_dir: str, results: list[dict], impls: list[str], env: dict, settings: dict) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, "bench")
    with open(base + ".json", "w") as f:
        json.dump({"env": env, "settings": settings, "impls": impls, "results": results}, f, indent=1)
    fields = ["label", "kind", "b", "s_k", "h", "s_q", "lens", "page", "sum_len", "max_len", "bytes", "flop",
              "plan_us", "plan_host_us", "ratio"]
    stats = ["us", "min_us", "reps", "host_us", "gbps", "tflops", "sm_mhz"]
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields + ["impl"] + stats + ["status"])
        for r in results:
            for n, v in r["impls"].items():
                w.writerow([r[k] for k in fields] + [n] + [v.get(k, "") for k in stats]
                           + [v.get("skip") or v.get("error") or "ok"])
    with open(base + ".md", "w") as f:
        f.write(markdown(results, impls, env, settings))
    files = [base + ext for ext in (".json", ".csv", ".md")]
    if plot_results(results, impls, base + ".png", f"MLA decode, {env.get('gpu')}"):
        files.append(base + ".png")
    return files
