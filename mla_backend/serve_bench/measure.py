"""Timing from token arrivals: per-request series of (time, tokens so far), and the statistics read from them.

Both engine runners feed a :class:`TokenTracker` as outputs arrive (vLLM: one engine step at a time, stamped with the
engine core's step time; SGLang: streamed chunks, stamped on arrival). Everything here is plain Python so that it can
be checked without a GPU.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestSeries:
    """One request: when it was submitted, its (time, cumulative output tokens) samples, its engine-reported time to
    first token where the engine gives one, and whether it finished."""

    submitted: float | None = None
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    engine_ttft: float | None = None
    finished: bool = False

    def record(self, time: float, tokens: int) -> None:
        if self.tokens and tokens <= self.tokens[-1]:
            return  # no new token (e.g. a repeated chunk)
        self.times.append(time)
        self.tokens.append(tokens)

    @property
    def count(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    @property
    def first_time(self) -> float | None:
        return self.times[0] if self.times else None

    def tokens_at(self, time: float) -> int:
        """Tokens received at or before ``time``."""
        i = bisect.bisect_right(self.times, time)
        return self.tokens[i - 1] if i else 0

    def reaching(self, tokens: int) -> tuple[float, int] | None:
        """The first sample with at least ``tokens`` tokens: (its time, its token count)."""
        i = bisect.bisect_left(self.tokens, tokens)
        return (self.times[i], self.tokens[i]) if i < len(self.tokens) else None

    def ttft(self) -> float | None:
        """Time to first token: the engine's own figure where given, else first arrival minus submission."""
        if self.engine_ttft is not None:
            return self.engine_ttft
        if self.submitted is None or not self.times:
            return None
        return self.times[0] - self.submitted


class TokenTracker:
    """Token arrivals of a set of requests, keyed by request id."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestSeries] = {}
        self.latest_time: float | None = None
        self.steps = 0  # batches of outputs received (vLLM: engine steps with output)

    def submit(self, key: str, time: float | None) -> None:
        self.requests.setdefault(key, RequestSeries()).submitted = time

    def record(self, key: str, time: float, tokens: int, finished: bool = False,
               engine_ttft: float | None = None) -> None:
        series = self.requests.setdefault(key, RequestSeries())
        series.record(time, tokens)
        if engine_ttft is not None and series.engine_ttft is None:
            series.engine_ttft = engine_ttft
        series.finished = series.finished or finished
        self.latest_time = time if self.latest_time is None else max(self.latest_time, time)

    def subset(self, keys) -> dict[str, RequestSeries]:
        return {k: self.requests.setdefault(k, RequestSeries()) for k in keys}

    def all_started(self, keys) -> bool:
        return all(self.requests.get(k) is not None and self.requests[k].count > 0 for k in keys)

    def any_finished(self, keys) -> bool:
        return any(self.requests.get(k) is not None and self.requests[k].finished for k in keys)

    def counts(self, keys) -> dict[str, int]:
        return {k: self.requests[k].count if k in self.requests else 0 for k in keys}

    def min_progress(self, base: dict[str, int]) -> int:
        """Fewest tokens any request in ``base`` has received since its count in ``base``."""
        return min(self.requests[k].count - n for k, n in base.items()) if base else 0


def full_batch_start(series: dict[str, RequestSeries]) -> float:
    """The time from which every request is decoding: the last first-token arrival (prefills are over)."""
    return max(s.first_time for s in series.values())


def decode_window_tpots(series: dict[str, RequestSeries], base: dict[str, int], warmup_steps: int,
                        window_steps: int, windows: int) -> list[float]:
    """Seconds per output token of the full batch, one value per window.

    Window ``j`` covers, for every request, the tokens ``base + warmup + j * window`` to the next ``window`` tokens,
    where ``base`` is its count when the last request got its first token (so every step inside is a decode step of
    the whole batch). Each request gives elapsed time over tokens between the first samples reaching the two counts
    (exact when samples arrive one step at a time, still exact in tokens when several steps arrive together); the
    window's value is the median over requests, which keeps a late arrival of one request out of it. Windows that no
    request completed are left out.
    """
    tpots = []
    for j in range(windows):
        per_request = []
        for key, s in series.items():
            start = base[key] + warmup_steps + j * window_steps
            begin, end = s.reaching(start), s.reaching(start + window_steps)
            if begin is None or end is None or end[1] <= begin[1]:
                continue
            per_request.append((end[0] - begin[0]) / (end[1] - begin[1]))
        if per_request:
            tpots.append(statistics.median(per_request))
    return tpots


def tpot_between(series: dict[str, RequestSeries], start: float, end: float) -> tuple[float | None, int]:
    """Median over requests of seconds per token between the first sample at or after ``start`` and the last at or
    before ``end``, and the tokens all requests received in between (requests with fewer than two samples there are
    left out of the median)."""
    per_request, tokens = [], 0
    for s in series.values():
        lo = bisect.bisect_left(s.times, start)
        hi = bisect.bisect_right(s.times, end) - 1
        if hi > lo and s.tokens[hi] > s.tokens[lo]:
            per_request.append((s.times[hi] - s.times[lo]) / (s.tokens[hi] - s.tokens[lo]))
        tokens += s.tokens_at(end) - s.tokens_at(start)
    return (statistics.median(per_request) if per_request else None), tokens


def request_tpots(series: dict[str, RequestSeries]) -> list[float]:
    """Per request: (last token time - first token time) / (tokens - 1), for requests with two or more tokens."""
    return [(s.times[-1] - s.times[0]) / (s.tokens[-1] - s.tokens[0])
            for s in series.values() if len(s.times) >= 2 and s.tokens[-1] > s.tokens[0]]


def summarize(values) -> dict | None:
    """Median and spread of the repeats: ``{"median", "min", "max", "n"}``, or None without values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
