"""The hostile workload of ``mla-backend serve-bench --workloads hostile``: what is sent, when, and what is aborted.

A run sends an open-ended stream of requests for :attr:`HostileLoad.seconds` seconds, keeping as many in flight as
the concurrency schedule says (it changes every :attr:`HostileLoad.phase_s` seconds), then lets the last ones finish.
Request ``i`` is a pure function of the seed and ``i`` (:func:`plan_request`), so the engine process that runs the
load and the reference engines that re-run its survivors rebuild the same prompts without shipping them:

* lengths from 1 to the max context: every 16th request fills the context exactly (prompt + output =
  ``max_context``), every 16th (offset 8) has a one-token prompt, the rest are log-uniform in between;
* prefix-cache hits: a share of the prompts start with one of a few shared prefixes (one page-aligned, the others
  not), so the engine's prefix cache serves part of their prefill;
* aborts mid-decode: a share of the requests are aborted once they have produced a planned number of tokens
  (at least one, fewer than they asked for);
* preemption: the KV pool (:attr:`HostileLoad.kv_tokens`) holds a few full-length requests while the schedule asks
  for many more, so the engine must preempt (vLLM) or retract (SGLang) running requests;
* chunked prefill: prompts longer than :attr:`HostileLoad.chunk_tokens` are prefilled in chunks.

:class:`LoadLedger` is the engine-independent bookkeeping both engine processes drive: what to submit now, what to
abort now, and how each request ended.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

FIRST_TOKEN_ID = 2  # ids 0 and 1 are the model's bos / eos
EXTREME_PERIOD = 16  # one request in this many fills the context, one has a one-token prompt
LONGEST_OFFSET, SHORTEST_OFFSET = 0, 8
PAGE_TOKENS = 64  # the page size both engines get (serve-bench's)

# How a request ended.
COMPLETED, ABORTED, FAILED, UNFINISHED = "completed", "aborted", "failed", "unfinished"
OUTCOMES = (COMPLETED, ABORTED, FAILED, UNFINISHED)


@dataclass(frozen=True)
class HostileLoad:
    """The load and the engine sizing that makes it hostile (the same for every backend)."""

    seconds: float = 120.0  # how long new requests are sent; the last ones then get ``drain_s`` to finish
    max_context: int = 8192  # prompt + output of the longest request; the engine's max model length
    max_output: int = 256  # most tokens one request generates
    kv_tokens: int = 0  # KV-pool tokens (0: 3 x max_context): a few full-length requests, far fewer than asked for
    chunk_tokens: int = 2048  # prefill chunk (vLLM max_num_batched_tokens, SGLang chunked_prefill_size)
    max_concurrency: int = 64  # the engine's max running requests, and the schedule's highest level
    concurrency_levels: tuple[int, ...] = (1, 4, 16, 32, 64)
    phase_s: float = 4.0  # the concurrency changes this often
    prefix_groups: int = 4  # shared prefixes
    prefix_share: float = 0.5  # share of the prompts that start with one
    abort_share: float = 0.2  # share of the requests aborted mid-decode
    mtp: bool = True  # one MTP draft token (vLLM "mtp", SGLang EAGLE): q_len 2 decode and verification
    forced_requests: int = 256  # most surviving requests re-run teacher-forced on the reference backends
    drain_s: float = 30.0  # for the requests in flight when sending stops
    seed: int = 0

    @property
    def pool_tokens(self) -> int:
        tokens = self.kv_tokens or 3 * self.max_context
        return -(-tokens // PAGE_TOKENS) * PAGE_TOKENS

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(sorted({min(level, self.max_concurrency) for level in self.concurrency_levels}))


def check_load(load: HostileLoad) -> None:
    """Raises ValueError naming the setting, its value and what is supported."""
    def bad(name: str, value, supported: str) -> None:
        raise ValueError(f"hostile load: {name}={value!r} is not supported; {supported}")

    if not load.seconds > 0:
        bad("seconds", load.seconds, "give a positive number of seconds")
    if load.max_context < 2 * PAGE_TOKENS:
        bad("max_context", load.max_context, f"use at least {2 * PAGE_TOKENS} tokens")
    if not 1 <= load.max_output < load.max_context:
        bad("max_output", load.max_output, f"use 1 .. max_context-1 ({load.max_context - 1})")
    if load.pool_tokens < load.max_context + 2 * PAGE_TOKENS:
        bad("kv_tokens", load.kv_tokens, f"the pool must hold one full-length request: at least max_context + "
                                         f"{2 * PAGE_TOKENS} = {load.max_context + 2 * PAGE_TOKENS} tokens")
    if load.chunk_tokens < PAGE_TOKENS:
        bad("chunk_tokens", load.chunk_tokens, f"use at least {PAGE_TOKENS}")
    if load.max_concurrency < 1:
        bad("max_concurrency", load.max_concurrency, "use at least 1")
    if not load.concurrency_levels or min(load.concurrency_levels) < 1:
        bad("concurrency_levels", load.concurrency_levels, "give one or more positive levels")
    if not load.phase_s > 0:
        bad("phase_s", load.phase_s, "give a positive number of seconds")
    if load.prefix_groups < 0:
        bad("prefix_groups", load.prefix_groups, "use 0 (no shared prefixes) or more")
    for name in ("prefix_share", "abort_share"):
        if not 0.0 <= getattr(load, name) <= 1.0:
            bad(name, getattr(load, name), "use a share from 0 to 1")
    if load.forced_requests < 0 or load.drain_s <= 0:
        bad("forced_requests/drain_s", (load.forced_requests, load.drain_s), "use >= 0 and > 0")


def load_to_dict(load: HostileLoad) -> dict:
    return dataclasses.asdict(load)


def load_from_dict(data: dict) -> HostileLoad:
    fields = dict(data)
    fields["concurrency_levels"] = tuple(fields.get("concurrency_levels", HostileLoad.concurrency_levels))
    return HostileLoad(**fields)


# ----------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class RequestPlan:
    """One request: its prompt, how many tokens it asks for, and when (if ever) it is aborted."""

    index: int
    prompt: list[int] = field(repr=False)
    max_tokens: int
    abort_after: int | None  # abort once this many output tokens have arrived (None: never)
    prefix_group: int | None  # which shared prefix the prompt starts with

    @property
    def key(self) -> str:
        return f"h{self.index}"


def _rng(load: HostileLoad, *parts) -> random.Random:
    """A generator per (seed, purpose, index): request i never depends on what was drawn for another."""
    return random.Random("/".join(map(str, (load.seed, *parts))))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    if high <= low:
        return low
    return min(high, max(low, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))))


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(count)]


def shared_prefixes(load: HostileLoad, vocab_size: int) -> list[list[int]]:
    """The shared prefixes: the first exactly four pages (a prefix cache can reuse all of it), the others not
    page-aligned and spread log-uniformly up to half the context."""
    prefixes = []
    for group in range(load.prefix_groups):
        rng = _rng(load, "prefix", group)
        length = 4 * PAGE_TOKENS if group == 0 else _log_uniform(rng, PAGE_TOKENS + 1, load.max_context // 2)
        if group and length % PAGE_TOKENS == 0:
            length += 1
        prefixes.append(_tokens(rng, min(length, load.max_context // 2), vocab_size))
    return prefixes


def plan_request(load: HostileLoad, vocab_size: int, index: int,
                 prefixes: list[list[int]] | None = None) -> RequestPlan:
    """Request ``index`` of the load (the same for the same seed, whoever asks)."""
    rng = _rng(load, "request", index)
    max_tokens = _log_uniform(rng, 1, load.max_output)
    room = load.max_context - max_tokens  # the longest prompt this request can have
    slot = index % EXTREME_PERIOD
    prefixes = shared_prefixes(load, vocab_size) if prefixes is None else prefixes
    group = None
    if prefixes and slot != SHORTEST_OFFSET and rng.random() < load.prefix_share:
        candidate = rng.randrange(len(prefixes))
        if len(prefixes[candidate]) < room:  # the prefix plus at least one token of its own
            group = candidate
    if slot == LONGEST_OFFSET:
        prompt_len = room
    elif slot == SHORTEST_OFFSET:
        prompt_len = 1
    elif group is not None:
        prompt_len = len(prefixes[group]) + _log_uniform(rng, 1, room - len(prefixes[group]))
    else:
        prompt_len = _log_uniform(rng, 1, room)
    head = prefixes[group] if group is not None else []
    prompt = head + _tokens(rng, prompt_len - len(head), vocab_size)
    abort_after = None
    if max_tokens >= 2 and rng.random() < load.abort_share:
        abort_after = rng.randint(1, max_tokens - 1)
    return RequestPlan(index, prompt, max_tokens, abort_after, group)


def concurrency_schedule(load: HostileLoad) -> list[tuple[float, int]]:
    """(start second, requests in flight) per phase; consecutive phases always differ (with two or more levels)."""
    levels, schedule, previous = load.levels, [], None
    for phase in range(max(1, math.ceil(load.seconds / load.phase_s))):
        choices = [level for level in levels if level != previous] or list(levels)
        previous = _rng(load, "phase", phase).choice(choices)
        schedule.append((phase * load.phase_s, previous))
    return schedule


def concurrency_at(schedule: list[tuple[float, int]], elapsed_s: float) -> int:
    level = schedule[0][1]
    for start, value in schedule:
        if start > elapsed_s:
            break
        level = value
    return level


# ----------------------------------------------------------------------------- bookkeeping
@dataclass
class RequestState:
    plan: RequestPlan
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    abort_sent: bool = False


def sending_window(load: HostileLoad, deadline: float, later_loads: int = 0, later_start_s: float = 0.0) -> float:
    """Seconds of sending that still leave the last requests ``drain_s`` before ``deadline`` (wall clock): an engine
    that started slower than planned sends for less rather than leaving requests unfinished. ``later_loads`` engines
    that run the same load after this one, before the same deadline, each starting in ``later_start_s``, get as long."""
    room = deadline - time.time() - load.drain_s - later_loads * (later_start_s + load.drain_s)
    return max(0.0, min(load.seconds, room / (1 + later_loads)))


class LoadLedger:
    """What an engine process submits and aborts, and how every request ended. Engine-independent: the runner feeds
    it the tokens and logprobs it sees and asks it what to do next."""

    def __init__(self, load: HostileLoad, vocab_size: int, start_s: float, send_s: float | None = None):
        """``send_s``: how long new requests go out (default ``load.seconds``; see :func:`sending_window`)."""
        self.load, self.vocab_size, self.start_s = load, vocab_size, start_s
        self.send_s = load.seconds if send_s is None else send_s
        self.schedule = concurrency_schedule(load)
        self.prefixes = shared_prefixes(load, vocab_size)
        self.in_flight: dict[str, RequestState] = {}
        self.records: list[dict] = []
        self.next_index = 0
        self.peak_in_flight = 0
        self.prefix_hit_tokens = 0  # prompt tokens the engine says it took from its prefix cache, where it says so

    @property
    def send_end(self) -> float:
        return self.start_s + self.send_s

    def sending(self, now_s: float) -> bool:
        return now_s < self.send_end

    def due(self, now_s: float) -> list[RequestPlan]:
        """The requests to submit now: enough to bring the in-flight count to the schedule's level."""
        if not self.sending(now_s):
            return []
        target = concurrency_at(self.schedule, now_s - self.start_s)
        plans = []
        while len(self.in_flight) < target:
            plan = plan_request(self.load, self.vocab_size, self.next_index, self.prefixes)
            self.next_index += 1
            self.in_flight[plan.key] = RequestState(plan)
            plans.append(plan)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        return plans

    def add_tokens(self, key: str, tokens, logprobs) -> None:
        state = self.in_flight.get(key)
        if state is not None:
            state.tokens.extend(int(t) for t in tokens)
            state.logprobs.extend(float(x) for x in logprobs)

    def set_tokens(self, key: str, tokens, logprobs) -> None:
        """For engines that report every token so far (SGLang's cumulative stream)."""
        state = self.in_flight.get(key)
        if state is not None:
            state.tokens, state.logprobs = [int(t) for t in tokens], [float(x) for x in logprobs]

    def aborts_due(self) -> list[str]:
        """Requests that reached their planned abort point and are still running; marked as sent."""
        keys = [k for k, s in self.in_flight.items() if s.plan.abort_after is not None and not s.abort_sent
                and len(s.tokens) >= s.plan.abort_after]
        for key in keys:
            self.in_flight[key].abort_sent = True
        return keys

    def finish(self, key: str, finish_reason: str | None, error: str | None = None) -> None:
        """The engine says ``key`` ended. A request aborted here counts as aborted whatever the engine says; any
        other must end by length with every token it asked for (ignore_eos) and finite logprobs."""
        state = self.in_flight.pop(key, None)
        if state is None:
            return
        plan = state.plan
        if state.abort_sent:
            outcome, why = ABORTED, None
        elif error is not None:
            outcome, why = FAILED, error
        elif finish_reason != "length" or len(state.tokens) != plan.max_tokens:
            outcome, why = FAILED, (f"finished with reason {finish_reason!r} after {len(state.tokens)} of "
                                    f"{plan.max_tokens} tokens")
        else:
            outcome, why = COMPLETED, None
        self.records.append(request_record(state, outcome, why))

    def close(self, reason: str) -> None:
        """Everything still in flight at the end: aborted if an abort was sent, otherwise unfinished."""
        for key in list(self.in_flight):
            state = self.in_flight.pop(key)
            outcome = ABORTED if state.abort_sent else UNFINISHED
            self.records.append(request_record(state, outcome, None if state.abort_sent else reason))


def request_record(state: RequestState, outcome: str, why: str | None) -> dict:
    plan = state.plan
    nonfinite = sum(1 for x in state.logprobs if not math.isfinite(x))
    record = {"index": plan.index, "outcome": outcome, "prompt_len": len(plan.prompt), "max_tokens": plan.max_tokens,
              "abort_after": plan.abort_after, "prefix_group": plan.prefix_group, "output": state.tokens,
              "logprobs_seen": len(state.logprobs), "nonfinite_logprobs": nonfinite}
    if why:
        record["reason"] = why
    return record


def forced_selection(records: list[dict], limit: int) -> list[dict]:
    """The completed requests re-run teacher-forced: all of them up to ``limit``, else the longest, the shortest
    prompt and the rest evenly spread (deterministic)."""
    done = sorted((r for r in records if r["outcome"] == COMPLETED and r["output"]), key=lambda r: r["index"])
    if len(done) <= limit:
        return done
    if limit <= 0:
        return []
    keep = {max(done, key=lambda r: r["prompt_len"] + len(r["output"]))["index"],
            min(done, key=lambda r: r["prompt_len"])["index"]}
    rest = [r for r in done if r["index"] not in keep]
    wanted = max(0, limit - len(keep))
    keep |= {rest[i * len(rest) // wanted]["index"] for i in range(wanted)} if wanted else set()
    return [r for r in done if r["index"] in keep][:limit]


# ----------------------------------------------------------------------------- engine processes
LOAD, FORCED = "load", "forced"


@dataclass
class HostileSpec:
    """One engine process of a hostile run: ``load`` runs the load on ``backend``; ``forced`` re-runs the survivors
    listed in ``sequences_path`` (request index and output tokens) as prompts and records the argmax per position."""

    mode: str  # LOAD or FORCED
    engine: str  # "vllm" or "sglang"
    backend: str
    model_dir: str
    vocab_size: int
    load: dict
    result_path: str
    log_path: str
    kv_cache_dtype: str = "auto"
    gpu_memory_fraction: float = 0.85
    sequences_path: str = ""
    deadline: float = float("inf")  # epoch seconds: the process stops working here and writes what it has
    later_loads: int = 0  # load engines still to come before ``deadline`` (they send as long as this one)
    later_start_s: float = 0.0  # the start planned for each of them

    @property
    def hostile_load(self) -> HostileLoad:
        return load_from_dict(self.load)

    def sending_s(self) -> float:
        """How long this load engine sends, from now (see :func:`sending_window`)."""
        return sending_window(self.hostile_load, self.deadline, self.later_loads, self.later_start_s)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load_file(cls, path) -> HostileSpec:
        return cls(**json.loads(Path(path).read_text()))


def forced_prompt(load: HostileLoad, vocab_size: int, index: int, output: list[int],
                  prefixes: list[list[int]]) -> tuple[list[int], int]:
    """The teacher-forced prompt of a survivor (its prompt, then the tokens it produced) and its prompt length."""
    prompt = plan_request(load, vocab_size, index, prefixes).prompt
    return prompt + list(output), len(prompt)
