"""``serve-bench --rounds N``: each backend measured by N engine processes, pooled into one record.

One engine process can run its host loop up to 1.5x slower than another of the same backend on the same machine
(RESULTS.md section 9: the same flashmla engine with EAGLE at 3.01 and 3.98 ms per token), which is more than the
backends differ where the step is host-bound. With ``--rounds`` the driver starts every backend's engine once per
round, the order reversed every other round (A B, then B A) so that each backend meets the machine's early and late
states alike; here each workload's repeats are pooled over a backend's engines, so its median and spread cover the
process-to-process variation, and each engine's own median is kept (``engine_medians``) for the report. With
``--resume`` a backend whose earlier run in the same ``--out-dir`` ran fewer engines (it stopped after fewer rounds, or
asked for fewer) keeps those engines and runs only the rounds it lacks, so the rounds of one report may span several
invocations: ``--rounds 2 --resume`` after a run of one engine per backend starts each backend's second engine.
"""

from __future__ import annotations

from .runner_common import measurement
from .workloads import workload_from_dict


def engines_run(result: dict) -> int:
    """How many engine processes a backend's result pools (1 for a result of one engine)."""
    return len(result.get("engines") or [result])


def resumed(kept: dict, rounds: int) -> dict:
    """A result kept by ``--resume`` that ran fewer than ``rounds`` engines, ready for this run to add the rest: the
    rounds its run did not start are no longer "skipped" (this run starts them), and ``kept_rounds`` says how many
    engines came from that run."""
    if engines_run(kept) >= rounds:
        return kept
    result = {key: value for key, value in kept.items() if key != "rounds_skipped"}
    result["kept_rounds"] = engines_run(kept)
    return result


def round_order(backends: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The backends' engine order in round ``round_index`` (0-based): as given, reversed every other round."""
    return backends if round_index % 2 == 0 else tuple(reversed(backends))


def _summaries(record: dict) -> dict[str, float]:
    """A workload record's median of every summarised number (measurement's ``{"median", ...}`` entries)."""
    return {key: value["median"] for key, value in record.items()
            if isinstance(value, dict) and value.get("median") is not None}


def _engine_entry(result: dict) -> dict:
    info = result.get("engine_info") or {}
    return {"status": result.get("status"), "start_s": info.get("start_s"), "cold_start_s": info.get("cold_start_s"),
            "wall_s": result.get("wall_s"), **({"reason": result["reason"]} if result.get("reason") else {})}


def _pool_workload(first: dict, later: dict | None, earlier_engines: int) -> dict:
    """``first`` (the record of the ``earlier_engines`` engines so far) with ``later``'s repeats added; profiles and
    host timers stay the first engine's. A workload the earlier engines did not measure (the time budget, an error)
    takes ``later``'s record, their medians ``None``; one ``later`` did not measure, or one without repeats (the
    forced check), stays as it was."""
    if later is None or later.get("status") != "ok" or "repeats" not in later:
        return first
    if first.get("status") != "ok":
        taken = dict(later)
        taken["engine_medians"] = {key: [None] * earlier_engines + [value]
                                   for key, value in _summaries(later).items()}
        return taken
    if "repeats" not in first:
        return first
    medians = first.get("engine_medians") or {key: [value] for key, value in _summaries(first).items()}
    later_medians = _summaries(later)
    extra = {key: value for key, value in first.items()
             if key not in ("workload", "kind", "params", "status", "repeats", "engine_medians")
             and not (isinstance(value, dict) and "median" in value)}
    pooled = measurement(workload_from_dict(first["params"]), first["repeats"] + later["repeats"], **extra)
    pooled["engine_medians"] = {key: values + [later_medians.get(key)] for key, values in medians.items()}
    return pooled


def pool(first: dict, later: dict) -> dict:
    """One backend's result over its engine processes so far (``first``, a driver result, pooled or not) and one
    more (``later``). ``engines`` lists every process's status and start time in order."""
    pooled = dict(first)
    pooled["engines"] = list(first.get("engines") or [_engine_entry(first)]) + [_engine_entry(later)]
    if later.get("status") == "done":
        by_name = {w["workload"]: w for w in later.get("workloads", [])}
        earlier = engines_run(first)
        pooled["workloads"] = [_pool_workload(w, by_name.get(w["workload"]), earlier)
                               for w in first.get("workloads", [])]
    return pooled
