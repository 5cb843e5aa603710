"""The hostile run's verdict: request outcomes, the engine's own counters, teacher-forced agreement, JSON and markdown.

Teacher-forced agreement: each surviving request's prompt + the tokens the serving engine produced (greedy) is re-run
as a prompt on a built-in backend (the reference, eager), which gives its own argmax at every position; the share of
output positions where that argmax equals the served token is the agreement. A served engine (CUDA graphs, compiled
fusions, MTP, chunked prefill, prefix cache) and an eager prompt pass round differently, and random weights leave
near ties that rounding decides either way, so the share is far below 1 for every backend. What it is read against is
therefore a built-in backend that served the same load in the same run (the baseline), forced by the same reference:
ours must agree as often, within ``--agreement-margin`` or three standard errors of the difference (requests as
clusters), whichever is larger.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .hostile_load import ABORTED, COMPLETED, FAILED, OUTCOMES, UNFINISHED

#: Our agreement may fall this far below the baseline's (or three standard errors of the difference, if more).
DEFAULT_AGREEMENT_MARGIN = 0.02


def agreement(tokens: dict[int, list[int]], argmax: dict[int, list[int]]) -> dict:
    """Share of positions where ``tokens[i][j] == argmax[i][j]``, over the requests both have (position-wise, up to
    the shorter of the two), with its standard error, the number of requests that agree everywhere and the first
    disagreements."""
    sizes, agrees = [], []
    first_disagreements = []
    common = sorted(set(tokens) & set(argmax))
    for index in common:
        ours, ref = tokens[index], argmax[index]
        n = min(len(ours), len(ref))
        same = sum(1 for j in range(n) if ours[j] == ref[j])
        sizes.append(n)
        agrees.append(same)
        if same < n and len(first_disagreements) < 8:
            first_disagreements.append({"request": index, "step": next(j for j in range(n) if ours[j] != ref[j])})
    steps, agree = sum(sizes), sum(agrees)
    return {"requests": len(common), "steps": steps, "agree": agree,
            "fraction": round(agree / steps, 5) if steps else None,
            "standard_error": _cluster_standard_error(sizes, agrees),
            "requests_agreeing_everywhere": sum(a == n for a, n in zip(agrees, sizes)),
            "first_disagreements": first_disagreements}


def allowed_gap(ours: dict, other: dict, margin: float = DEFAULT_AGREEMENT_MARGIN) -> float:
    """How far ``ours``' agreement may fall below ``other``'s (two :func:`agreement` records): ``margin``, or three
    standard errors of the difference where both have one and that is larger."""
    if ours["standard_error"] is None or other["standard_error"] is None:
        return margin
    return max(margin, 3 * math.hypot(ours["standard_error"], other["standard_error"]))


def _cluster_standard_error(sizes: list[int], agrees: list[int]) -> float | None:
    """Standard error of the agreement share with each request a cluster (its steps are not independent: one near
    tie decided differently changes the rest of its context). ``sizes`` / ``agrees``: steps and agreeing steps per
    request."""
    n, total = len(sizes), sum(sizes)
    if n < 2 or not total:
        return None
    share = sum(agrees) / total
    spread = sum((a - share * m) ** 2 for a, m in zip(agrees, sizes)) / (n * (n - 1))
    return round(math.sqrt(spread) * n / total, 5)


def outcome_counts(records: list[dict]) -> dict:
    counts = {outcome: 0 for outcome in OUTCOMES}
    for record in records:
        counts[record["outcome"]] += 1
    counts["sent"] = len(records)
    return counts


def load_checks(load_result: dict) -> dict:
    """What one load engine's result says about the requests, the logprobs and the engine's own error counters."""
    records = load_result.get("records", [])
    counts = outcome_counts(records)
    nonfinite = sum(r["nonfinite_logprobs"] for r in records)
    # At least one per token: after a retraction SGLang's stream sends some again (seen: 2415 for 70 tokens).
    missing_logprobs = sum(1 for r in records if r["outcome"] == COMPLETED and r["logprobs_seen"] < len(r["output"]))
    errors = load_result.get("engine_errors", {})
    return {
        "engine_ran": {"ok": load_result.get("status") == "done",
                       "detail": load_result.get("error") or load_result.get("status")},
        "every_request_accounted": {"ok": counts[FAILED] == 0 and counts[UNFINISHED] == 0 and counts["sent"] > 0,
                                    "detail": f"{counts[FAILED]} failed, {counts[UNFINISHED]} unfinished of "
                                              f"{counts['sent']} sent"},
        "finite_logprobs": {"ok": nonfinite == 0 and missing_logprobs == 0,
                            "detail": f"{nonfinite} non-finite logprobs; {missing_logprobs} completed requests "
                                      "without a logprob per token"},
        "engine_error_counters_zero": {"ok": bool(errors.get("readable", False)) and not any(
            v for k, v in errors.items() if k not in ("readable", "source", "note")), "detail": errors},
    }


def load_summary(load_result: dict) -> dict:
    return {"counts": outcome_counts(load_result.get("records", [])), "preemptions": load_result.get("preemptions"),
            "prefix_cache": load_result.get("prefix_cache"), "spec_decode": load_result.get("spec_decode"),
            "peak_in_flight": load_result.get("peak_in_flight"), "sent_s": load_result.get("sent_s"),
            "engine_errors": load_result.get("engine_errors", {})}


def summarize(load_result: dict, reference: tuple[str, dict] | None = None, baseline: tuple[str, dict] | None = None,
              margin: float = DEFAULT_AGREEMENT_MARGIN) -> dict:
    """The verdict of one run. ``load_result``: our load engine's result file; ``reference``: (backend, its forced
    result file, whose ``argmax`` maps a source, "ours" or "baseline", to request index -> argmax per output
    position); ``baseline``: (backend, the result file of the built-in that served the same load)."""
    checks = load_checks(load_result)
    agreement_record = {}
    if reference:
        ref_name, ref_result = reference
        ours = agreement(_completed(load_result), _argmax(ref_result, "ours"))
        agreement_record["ours_vs_" + ref_name] = ours
        results = {ref_name: ref_result}
        base = None
        if baseline:
            base_name, base_result = baseline
            results[base_name] = base_result
            base = agreement(_completed(base_result), _argmax(ref_result, "baseline"))
            agreement_record[f"{base_name}_vs_{ref_name}"] = base
        allowed = allowed_gap(ours, base, margin) if base is not None else margin
        ok = ours["fraction"] is not None and (base is None or (base["fraction"] is not None
                                                                and ours["fraction"] >= base["fraction"] - allowed))
        checks["teacher_forced_agreement"] = {
            "ok": ok and all(r.get("status") == "done" for r in results.values()),
            "detail": f"ours {ours['fraction']}, built-in under the same load {base and base['fraction']}, allowed "
                      f"{round(allowed, 5)} less; " + "; ".join(f"{b}: {r.get('status')}" + (
                          f" ({r['error']})" if r.get("error") else "") for b, r in results.items())}
    summary = load_summary(load_result)
    summary.update(agreement=agreement_record, checks=checks, passed=all(c["ok"] for c in checks.values()))
    if baseline:
        summary["baseline"] = load_summary(baseline[1])
    return summary


def _completed(load_result: dict) -> dict[int, list[int]]:
    return {r["index"]: r["output"] for r in load_result.get("records", []) if r["outcome"] == COMPLETED}


def _argmax(forced_result: dict, source: str) -> dict[int, list[int]]:
    return {int(k): v for k, v in ((forced_result.get("argmax") or {}).get(source) or {}).items()}


def markdown(report: dict) -> str:
    """Two tables: what happened to the requests in each load engine (and its counters), and the agreement."""
    s = report["summary"]
    lines = [f"### Hostile load: {report['engine']} {report.get('engine_version') or ''}, ours = {report['ours']}"
             f"{' + MTP' if report['load']['mtp'] else ''}",
             "",
             "| served by | sent for | sent | completed | aborted | failed | unfinished | preemptions | "
             "prefix-cache hit tokens | peak in flight |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
             _load_row(report["ours"] + " (ours)", s)]
    if s.get("baseline"):
        lines.append(_load_row(report["backends"][2] + " (baseline)", s["baseline"]))
    lines += ["", f"Passed: {'yes' if s['passed'] else 'NO'}", "",
              "| teacher-forced pair | requests | steps | agreement | standard error | requests agreeing everywhere |",
              "|---|---:|---:|---:|---:|---:|"]
    for pair, a in s["agreement"].items():
        lines.append(f"| {pair.replace('_vs_', ' vs ')} | {a['requests']} | {a['steps']} | {_cell(a['fraction'])} | "
                     f"{_cell(a.get('standard_error'))} | {a['requests_agreeing_everywhere']} |")
    lines += ["", "| check | ok | detail |", "|---|:--|---|"]
    for name, check in s["checks"].items():
        detail = json.dumps(check["detail"]) if isinstance(check["detail"], dict) else str(check["detail"])
        lines.append(f"| {name} | {'yes' if check['ok'] else 'NO'} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _load_row(name: str, s: dict) -> str:
    c = s["counts"]
    return (f"| {name} | {_cell(s.get('sent_s'))} s | {c['sent']} | {c[COMPLETED]} | {c[ABORTED]} | {c[FAILED]} | "
            f"{c[UNFINISHED]} | {_cell(s['preemptions'])} | {_cell((s.get('prefix_cache') or {}).get('hit_tokens'))} "
            f"| {_cell(s['peak_in_flight'])} |")


def _cell(value) -> str:
    return "-" if value is None else str(value)


def write_outputs(out_dir: Path, report: dict) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "hostile.json", out_dir / "hostile.md"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    md_path.write_text(markdown(report))
    return [str(json_path), str(md_path)]
