"""``serve-bench --verify``: our decode calls checked against the fp32 reference inside every engine process.

Each engine runs eager with ``MLA_BACKEND_VERIFY=1`` (verify.py): every decode call of our backend is recomputed by
the fp32 reference on its own rank's inputs, and each process keeps its call count and worst errors. After the
workloads the runner collects one report per process (vLLM: ``collective_rpc`` to each worker; SGLang: the report
files of each scheduler), so a tensor-parallel or DP-attention run shows every rank. Ours passes when every rank
checked at least one call and none was past ``verify.MAX_REL_ERR`` / ``verify.MAX_LSE_ERR``. Unlike the forced
agreement, this does not depend on how chaotic the random-weight model is.
"""

from __future__ import annotations

from ..verify import limits, within_limits


def verdict(data: dict) -> dict | None:
    """Ours' ranks and whether they pass; None where the run did not verify or ours did not run its workloads."""
    if not data["settings"].get("verify"):
        return None
    result = data["backends"].get(data["settings"]["ours"]) or {}
    if result.get("status") != "done":
        return None
    ranks = result.get("verification") or []
    if not ranks:
        return {"ranks": [], "passed": False,
                "reason": "no engine process reported a verification (MLA_BACKEND_VERIFY=1 did not reach it)"}
    failing = [r.get("rank") for r in ranks if not within_limits(r)]
    return {"ranks": ranks, "passed": not failing,
            "reason": f"ranks {failing} checked no call or were past the limits" if failing else None}


def markdown(data: dict) -> list[str]:
    """The per-rank table and the verdict (nothing where the run did not verify)."""
    found = verdict(data)
    if found is None:
        return []
    lines = [f"#### fp32 verification of {data['settings']['ours']} (`MLA_BACKEND_VERIFY=1`, eager engine)", ""]
    if found["ranks"]:
        lines += ["| rank | decode calls checked (by q_len) | max relative error | max LSE error |",
                  "|---|---|---|---|"]
        for r in found["ranks"]:
            by_q_len = ", ".join(f"{q}: {n}" for q, n in sorted(r.get("calls_by_q_len", {}).items()))
            lines.append(f"| {r.get('rank')} | {r.get('calls', 0)} ({by_q_len}) | {r.get('max_rel_err', 0):.2e} | "
                         f"{r.get('max_lse_err', 0):.2e} |")
        lines.append("")
    status = "**PASS**" if found["passed"] else f"**FAIL**: {found['reason']}"
    fp8c = any(r.get("fp8_compute_calls", 0) for r in found["ranks"])
    max_rel, max_lse = limits(fp8c)
    lines += [f"Limits: relative error {max_rel:g}, LSE error {max_lse:g}{' (fp8 compute)' if fp8c else ''}, at least "
              f"one call per rank: {status}", ""]
    return lines
