"""Teacher-forced agreement between the backends of one serve-bench run (the ``forced`` workload).

Every backend's engine decoded the same prompts under the same scripted tokens and recorded, at each step, its
model's own argmax. Two correct backends still differ where random weights leave a near tie that rounding decides
either way, so ours is read against how often the built-ins agree with each other in the same run: it passes when its
median agreement with the built-ins is at least the built-ins' median agreement between themselves, less
``margin`` or three standard errors of the difference (each request a cluster), whichever is larger
(``hostile_report.allowed_gap``, the hostile load's rule).

Where the built-ins agree with each other on fewer than ``WEAK_BELOW`` of the steps, rounding decides most argmaxes
of the model (random weights at DeepSeek-V3's width and depth, with fp8 activations and expert routing that a
rounding difference can flip) and a broken kernel could hide in that noise: the verdict is marked weak, and the
in-engine fp32 check (``--verify``, verification.py) is the one that holds each decode call to the reference.
"""

from __future__ import annotations

from itertools import combinations

from .hostile_report import DEFAULT_AGREEMENT_MARGIN, agreement, allowed_gap
from .workloads import FORCED

#: Built-ins agreeing on fewer steps than this leave the verdict too little signal to tell a kernel error from noise.
WEAK_BELOW = 0.5


def forced_argmax(data: dict, workload: str) -> dict[str, dict[int, list[int]]]:
    """Backend -> {request index: argmax per step} for the backends whose forced record holds."""
    found = {}
    for backend, result in data["backends"].items():
        for record in result.get("workloads", []):
            if record.get("workload") == workload and record.get("status") == "ok":
                found[backend] = dict(enumerate(record["argmax"]))
    return found


def _median_pair(pairs: list[dict]) -> dict:
    return sorted(pairs, key=lambda p: p["fraction"])[(len(pairs) - 1) // 2]


def compare(data: dict, margin: float = DEFAULT_AGREEMENT_MARGIN) -> dict[str, dict]:
    """Per forced workload: every pair's agreement and the verdict (``passed`` None where the run has no two
    built-ins to read ours against, or ours did not run)."""
    ours = data["settings"]["ours"]
    kinds = data["settings"].get("workload_kinds", {})
    verdicts = {}
    for workload in (w for w in data["settings"]["workloads"] if kinds.get(w) == FORCED):
        argmax = forced_argmax(data, workload)
        pairs = []
        for a, b in combinations(argmax, 2):
            pair = agreement(argmax[a], argmax[b])
            if pair["fraction"] is not None:
                pairs.append(dict(pair, backends=(a, b), ours=ours in (a, b)))
        with_ours = [p for p in pairs if p["ours"]]
        built_in = [p for p in pairs if not p["ours"]]
        verdict = {"pairs": pairs, "passed": None}
        if with_ours and built_in:
            mine, theirs = _median_pair(with_ours), _median_pair(built_in)
            allowed = allowed_gap(mine, theirs, margin)
            verdict.update(ours_median=mine["fraction"], built_in_median=theirs["fraction"], allowed=round(allowed, 5),
                           passed=mine["fraction"] >= theirs["fraction"] - allowed,
                           weak=theirs["fraction"] < WEAK_BELOW)
        verdicts[workload] = verdict
    return verdicts


def markdown(data: dict) -> list[str]:
    """The agreement table of each forced workload, and its verdict."""
    lines = []
    for workload, verdict in compare(data).items():
        lines += [f"#### Teacher-forced agreement: {workload} (per-step argmax equal)", "",
                  "| backends | steps | agreement (SE) | requests equal everywhere |", "|---|---|---|---|"]
        for p in verdict["pairs"]:
            se = f" ({p['standard_error']:.3f})" if p["standard_error"] is not None else ""
            lines.append(f"| {p['backends'][0]} vs {p['backends'][1]} | {p['steps']} | {p['fraction']:.3f}{se} | "
                         f"{p['requests_agreeing_everywhere']} of {p['requests']} |")
        if verdict["passed"] is None:
            lines.append("")
            lines.append("No verdict: it needs ours and at least two built-ins with a forced record that holds.")
        else:
            lines += ["", f"Ours vs the built-ins (median) {verdict['ours_median']:.3f}; built-ins among themselves "
                      f"(median) {verdict['built_in_median']:.3f}; allowed gap {verdict['allowed']:.3f}: "
                      f"**{'PASS' if verdict['passed'] else 'FAIL'}**"]
            if verdict["weak"]:
                lines += ["", f"Weak verdict: the built-ins agree on fewer than {WEAK_BELOW:.0%} of the steps, so "
                          "rounding decides most of this model's argmaxes and an error in a kernel could hide in that "
                          "noise. `--verify` checks every decode call against the fp32 reference on every rank "
                          "instead."]
        lines.append("")
    return lines
