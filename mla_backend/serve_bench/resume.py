"""``serve-bench --resume``: the backends an earlier run in the same ``--out-dir`` measured are kept, and only the
others start an engine.

One comparison can then be spread over several invocations, each shorter than a time limit (an engine of the real
model over several GPUs takes minutes to start), and still end in one report and one teacher-forced verdict. An
earlier run counts only when it measured the same thing: the same settings and model (the backend list, budget,
wall time and ``--rounds`` aside) on the same GPU, driver and versions; otherwise ``--resume`` refuses and says what
differs. A larger ``--rounds`` than the earlier run's adds engine processes to its backends (rounds.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from .report import BASENAME

#: Settings that may differ between the runs of one report.
FREE_SETTINGS = ("backends", "budget_s", "wall_s", "rounds")
#: Environment entries that must match: weights, kernels and timings depend on them.
SAME_ENVIRONMENT = ("gpu", "driver", "torch", "vllm", "sglang", "tilelang", "flashinfer-python", "mla-backend")
#: What a kept backend's ``from_run`` records of the run that measured it.
PROVENANCE = ("date", "command", "git")


def _as_json(value):
    return json.loads(json.dumps(value, default=str))


def differences(earlier: dict, settings: dict, model_config: dict, env: dict) -> list[str]:
    """``"key: earlier -> now"`` for every setting, model field and environment entry that differs."""
    found = []
    now, before = _as_json(settings), earlier["settings"]
    for key in sorted(set(now) | set(before)):
        if key not in FREE_SETTINGS and now.get(key) != before.get(key):
            found.append(f"{key}: {before.get(key)!r} -> {now.get(key)!r}")
    config_now, config_before = _as_json(model_config), earlier["model"]["config"]
    for key in sorted(set(config_now) | set(config_before)):
        if config_now.get(key) != config_before.get(key):
            found.append(f"model {key}: {config_before.get(key)!r} -> {config_now.get(key)!r}")
    for key in SAME_ENVIRONMENT:
        if env.get(key) is not None and env.get(key) != earlier["env"].get(key):
            found.append(f"{key}: {earlier['env'].get(key)!r} -> {env.get(key)!r}")
    return found


def kept_backends(out_dir: str | Path, settings: dict, model_config: dict, env: dict) -> dict[str, dict]:
    """Backend -> result of every backend whose engine finished in ``out_dir``'s earlier report (none when there is
    no report), each with ``from_run``. ValueError when that report measured something else."""
    path = Path(out_dir) / f"{BASENAME}.json"
    if not path.exists():
        return {}
    try:
        earlier = json.loads(path.read_text())
        found = differences(earlier, settings, model_config, env)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: cannot read {path} as a serve-bench report ({e}); use another --out-dir") from e
    if found:
        raise ValueError(f"--resume: {path} measured something else ({'; '.join(found)}); run with the same "
                         f"settings, or use another --out-dir")
    provenance = {key: earlier["env"].get(key) for key in PROVENANCE}
    return {backend: dict(result, from_run=result.get("from_run") or provenance)
            for backend, result in earlier["backends"].items() if result.get("status") == "done"}
