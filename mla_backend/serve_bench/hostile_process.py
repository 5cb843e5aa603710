"""What both engines' hostile processes share: the forced mode's loop over the survivors and the process entry.

Each engine module (hostile_vllm.py, hostile_sglang.py) brings its own ``run_load`` and a ``force_batch`` that turns
teacher-forced prompts into the engine's argmax at every output position; everything around them is here.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from .hostile_load import FORCED, LOAD, HostileSpec, forced_prompt, shared_prefixes
from .runner_common import log_tail, refusal_reason, write_result

FORCED_BATCH = 64  # requests per generate call in forced mode (progress is written after each)
PROGRESS_EVERY_S = 15.0  # how often the load mode writes its ledger while it runs

#: ``force_batch([(prompt + output tokens, prompt length), ...])`` -> each one's argmax tokens at its output positions.
ForceBatch = Callable[[list[tuple[list[int], int]]], list[list[int]]]


def force_survivors(spec: HostileSpec, result: dict, engine_info: dict, force_batch: ForceBatch) -> None:
    """Forced mode: every survivor listed in ``spec.sequences_path`` through ``force_batch``, ``FORCED_BATCH`` at a
    time, until the deadline (the first batch runs even past it, within the kill grace, so that a slow engine start
    still yields an agreement); ``result["argmax"]`` maps each survivor's source (the load engine that produced it)
    to {request index: argmax tokens}."""
    load = spec.hostile_load
    survivors = json.loads(Path(spec.sequences_path).read_text())
    result.update(status="running", engine_info=engine_info, argmax={})
    prefixes = shared_prefixes(load, spec.vocab_size)
    for start in range(0, len(survivors), FORCED_BATCH):
        if start and time.time() > spec.deadline:
            result["stopped_early"] = f"time budget: {start} of {len(survivors)} requests forced"
            break
        batch = survivors[start:start + FORCED_BATCH]
        prompts = [forced_prompt(load, spec.vocab_size, s["index"], s["output"], prefixes) for s in batch]
        for survivor, tokens in zip(batch, force_batch(prompts)):
            result["argmax"].setdefault(survivor["source"], {})[survivor["index"]] = tokens
        write_result(spec.result_path, result)
    result["status"] = "done"


def process_main(engine: str, run_load: Callable[[HostileSpec, dict], None],
                 run_forced: Callable[[HostileSpec, dict], None], argv: list[str] | None = None) -> int:
    """``python -m mla_backend.serve_bench.hostile_<engine> SPEC_JSON``: runs the spec's mode and always leaves a
    result file (a refusal or a crash is a result, with the engine's reason)."""
    spec = HostileSpec.load_file((sys.argv[1:] if argv is None else argv)[0])
    result = {"engine": engine, "backend": spec.backend, "mode": spec.mode, "status": "starting"}
    write_result(spec.result_path, result)
    t0 = time.perf_counter()
    try:
        if spec.mode == LOAD:
            run_load(spec, result)
        elif spec.mode == FORCED:
            run_forced(spec, result)
        else:
            raise ValueError(f"mode={spec.mode!r} is not supported; use {LOAD!r} or {FORCED!r}")
    except Exception as e:  # noqa: BLE001 - a refusal or crash is a result
        result.update(status="refused" if result["status"] == "starting" else "failed",
                      error=refusal_reason(e, log_tail(spec.log_path)), traceback=traceback.format_exc()[-3000:])
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(spec.result_path, result)
    return 0 if result["status"] == "done" else 1
