"""``MLA_BACKEND_VERIFY=1``: every eager kernel call recomputed by the fp32 reference, the worst error kept.

A debugging aid for engine integrations: each check syncs the device, so never in production. The environment is
read once, when this module is imported (an engine sets it before it loads the plugin).
"""

from __future__ import annotations

import logging
import math
import os

from .reference import mla_decode_reference

logger = logging.getLogger("mla_backend")

#: Worst relative error of ``out`` and absolute error of the LSE a checked call may have (bf16 rounding of a
#: 512-wide output and of exp-sums over long contexts stays an order of magnitude below).
MAX_REL_ERR, MAX_LSE_ERR = 2e-2, 1e-2
#: The same for the e4m3-compute kernel (``fp8_compute``): q and P rounded to e4m3 (3 mantissa bits) move the output by
#: a few 1e-2 of its norm and the LSE by up to ~0.15 on random inputs; FlashMLA's fp8 path lies in the same range.
MAX_REL_ERR_FP8_COMPUTE, MAX_LSE_ERR_FP8_COMPUTE = 8e-2, 0.4
VERIFY = {"calls": 0, "max_rel_err": 0.0, "max_lse_err": 0.0, "calls_by_q_len": {}, "fp8_compute_calls": 0,
          "over_limit": 0}
ENV_VERIFY = "MLA_BACKEND_VERIFY"
VERIFYING = os.environ.get(ENV_VERIFY) == "1"


def limits(fp8_compute: bool = False) -> tuple[float, float]:
    """``(max relative error, max LSE error)`` a checked call may have: the ``*_FP8_COMPUTE`` pair for the e4m3-compute
    kernel."""
    return (MAX_REL_ERR_FP8_COMPUTE, MAX_LSE_ERR_FP8_COMPUTE) if fp8_compute else (MAX_REL_ERR, MAX_LSE_ERR)


def verifying() -> bool:
    """MLA_BACKEND_VERIFY=1 at import: eager kernel calls are recomputed by the reference (results in ``VERIFY``)."""
    return VERIFYING


def verify_call(q_nope, q_pe, kv_cache, metadata, softmax_scale: float, k_scale, out, lse,
                fp8_compute: bool = False) -> None:
    """Compare one kernel call's ``out`` / ``lse`` with the reference (on the kernel's device: it gathers only each
    request's pages, never the whole cache) and update ``VERIFY``; a warning past ``MAX_REL_ERR`` / ``MAX_LSE_ERR``."""
    scale = float(k_scale) if k_scale is not None else 1.0
    ref, ref_lse = mla_decode_reference(q_nope, q_pe, kv_cache, metadata, softmax_scale, scale)
    err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))
    finite = ref_lse.isfinite()
    lse_err = float((lse[finite] - ref_lse[finite]).abs().max()) if bool(finite.any()) else 0.0
    VERIFY["calls"] += 1
    by_q_len = VERIFY["calls_by_q_len"]
    by_q_len[str(metadata.q_len)] = by_q_len.get(str(metadata.q_len), 0) + 1
    VERIFY["max_rel_err"] = _worst(VERIFY["max_rel_err"], err)
    VERIFY["max_lse_err"] = _worst(VERIFY["max_lse_err"], lse_err)
    max_rel, max_lse = limits(fp8_compute)
    VERIFY["fp8_compute_calls"] += int(fp8_compute)
    if not (err <= max_rel and lse_err <= max_lse):  # a NaN error counts as past the limit
        VERIFY["over_limit"] += 1
        logger.warning("mla_backend verify: rel err %.3e, LSE err %.3e (batch %d, q_len %s, page %d)", err, lse_err,
                       metadata.batch_size, metadata.q_len, metadata.page_size)


def _worst(kept: float, new: float) -> float:
    """The larger error, NaN winning (``max(x, nan)`` keeps ``x`` and would hide the call)."""
    return new if math.isnan(new) or new > kept else kept


def verification_report() -> dict | None:
    """Under MLA_BACKEND_VERIFY=1, a copy of the verification counters (``calls``, ``max_rel_err``, ``max_lse_err``,
    ``calls_by_q_len``); None while verification is off."""
    if not VERIFYING:
        return None
    return dict(VERIFY, calls_by_q_len=dict(VERIFY["calls_by_q_len"]))


def within_limits(report: dict) -> bool:
    """Whether a :func:`verification_report` checked at least one call and every one within its limits (the
    ``*_FP8_COMPUTE`` ones for the e4m3-compute kernel's calls)."""
    if report.get("calls", 0) <= 0 or report.get("over_limit", 0):
        return False
    max_rel, max_lse = limits(bool(report.get("fp8_compute_calls", 0)))
    return report["max_rel_err"] <= max_rel and report["max_lse_err"] <= max_lse
