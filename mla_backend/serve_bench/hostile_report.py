"""The hostile run's verdict: request outcomes, the engine's own counters, teacher-forced agreement, JSON and markdown.

Teacher-forced agreement: each surviving request's prompt + the tokens our backend produced (greedy) is re-run as a
prompt on a built-in backend (the reference), which gives its own argmax at every position; the share of output
positions where that argmax equals our token is our agreement. The same sequences on a second built-in backend give
how often two correct backends agree on them, the baseline our share is read against (random weights leave near
ties that bf16 rounding decides either way).
"""

from __future__ import annotations

import json
from pathlib import Path

from .hostile_load import ABORTED, COMPLETED, FAILED, OUTCOMES, UNFINISHED

#: Our agreement may fall this far below the two built-ins' before the run fails.
DEFAULT_AGREEMENT_MARGIN = 0.02


def agreement(tokens: dict[int, list[int]], argmax: dict[int, list[int]]) -> dict:
    """Share of positions where ``tokens[i][j] == argmax[i][j]``, over the requests both have (position-wise, up to
    the shorter of the two), with the number of requests that agree everywhere and the first disagreements."""
    steps = agree = whole = 0
    first_disagreements = []
    common = sorted(set(tokens) & set(argmax))
    for index in common:
        ours, ref = tokens[index], argmax[index]
        n = min(len(ours), len(ref))
        same = sum(1 for j in range(n) if ours[j] == ref[j])
        steps += n
        agree += same
        whole += same == n
        if same < n and len(first_disagreements) < 8:
            first_disagreements.append({"request": index, "step": next(j for j in range(n) if ours[j] != ref[j])})
    return {"requests": len(common), "steps": steps, "agree": agree,
            "fraction": round(agree / steps, 5) if steps else None, "requests_agreeing_everywhere": whole,
            "first_disagreements": first_disagreements}


def outcome_counts(records: list[dict]) -> dict:
    counts = {outcome: 0 for outcome in OUTCOMES}
    for record in records:
        counts[record["outcome"]] += 1
    counts["sent"] = len(records)
    return counts


def summarize(load_result: dict, forced: dict[str, dict], margin: float = DEFAULT_AGREEMENT_MARGIN) -> dict:
    """The verdict of one run. ``load_result``: the load engine's result file; ``forced``: reference backend ->
    its forced result file (``argmax``: request index -> argmax per output position), in order: the reference
    first, the baseline second."""
    records = load_result.get("records", [])
    counts = outcome_counts(records)
    nonfinite = sum(r["nonfinite_logprobs"] for r in records)
    missing_logprobs = sum(1 for r in records if r["outcome"] == COMPLETED and r["logprobs_seen"] != len(r["output"]))
    errors = load_result.get("engine_errors", {})
    checks = {
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
    backends = list(forced)
    agreement_record = {}
    if backends:
        reference = forced[backends[0]]
        ours_tokens = {r["index"]: r["output"] for r in records if r["outcome"] == COMPLETED}
        ref_argmax = _argmax(reference)
        agreement_record["ours_vs_" + backends[0]] = agreement(ours_tokens, ref_argmax)
        if len(backends) > 1:
            agreement_record[f"{backends[1]}_vs_{backends[0]}"] = agreement(_argmax(forced[backends[1]]), ref_argmax)
        ours = agreement_record["ours_vs_" + backends[0]]["fraction"]
        base = agreement_record[f"{backends[1]}_vs_{backends[0]}"]["fraction"] if len(backends) > 1 else None
        ok = ours is not None and (base is None or ours >= base - margin)
        checks["teacher_forced_agreement"] = {
            "ok": ok and all(f.get("status") == "done" for f in forced.values()),
            "detail": f"ours {ours}, built-ins {base}, margin {margin}; "
                      + "; ".join(f"{b}: {f.get('status')}" + (f" ({f['error']})" if f.get("error") else "")
                                  for b, f in forced.items())}
    return {"counts": counts, "preemptions": load_result.get("preemptions"),
            "prefix_cache": load_result.get("prefix_cache"), "spec_decode": load_result.get("spec_decode"),
            "peak_in_flight": load_result.get("peak_in_flight"), "sent_s": load_result.get("sent_s"),
            "engine_errors": errors,
            "agreement": agreement_record, "checks": checks, "passed": all(c["ok"] for c in checks.values())}


def _argmax(forced_result: dict) -> dict[int, list[int]]:
    return {int(k): v for k, v in (forced_result.get("argmax") or {}).items()}


def markdown(report: dict) -> str:
    """Two tables: what happened to the requests (and the engine's counters), and the agreement."""
    s = report["summary"]
    c = s["counts"]
    lines = [f"### Hostile load: {report['engine']} {report.get('engine_version') or ''}, ours = {report['ours']}"
             f"{' + MTP' if report['load']['mtp'] else ''}, requests sent for "
             f"{report['load']['seconds'] if s.get('sent_s') is None else s['sent_s']:.0f} s",
             "",
             "| sent | completed | aborted | failed | unfinished | preemptions | prefix-cache hit tokens | "
             "peak in flight | passed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|:--|",
             f"| {c['sent']} | {c[COMPLETED]} | {c[ABORTED]} | {c[FAILED]} | {c[UNFINISHED]} | "
             f"{_cell(s['preemptions'])} | {_cell((s.get('prefix_cache') or {}).get('hit_tokens'))} | "
             f"{_cell(s['peak_in_flight'])} | {'yes' if s['passed'] else 'NO'} |",
             "",
             "| teacher-forced pair | requests | steps | agreement | requests agreeing everywhere |",
             "|---|---:|---:|---:|---:|"]
    for pair, a in s["agreement"].items():
        lines.append(f"| {pair.replace('_vs_', ' vs ')} | {a['requests']} | {a['steps']} | {_cell(a['fraction'])} | "
                     f"{a['requests_agreeing_everywhere']} |")
    lines += ["", "| check | ok | detail |", "|---|:--|---|"]
    for name, check in s["checks"].items():
        detail = json.dumps(check["detail"]) if isinstance(check["detail"], dict) else str(check["detail"])
        lines.append(f"| {name} | {'yes' if check['ok'] else 'NO'} | {detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    return "-" if value is None else str(value)


def write_outputs(out_dir: Path, report: dict) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "hostile.json", out_dir / "hostile.md"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    md_path.write_text(markdown(report))
    return [str(json_path), str(md_path)]
