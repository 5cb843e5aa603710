"""What serve-bench measures: decode cells, a decode-heavy throughput load, a mixed chunked-prefill load and a
teacher-forced agreement check, and the settings that say how each is timed.

Every workload is a small frozen dataclass that travels to the engine process as JSON (:func:`workload_to_dict`,
:func:`workload_from_dict`). Prompts are random token ids (no tokenizer), seeded, so every backend sees the same
requests.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

DECODE, THROUGHPUT, MIXED, FORCED = "decode", "throughput", "mixed", "forced"
WORKLOAD_KINDS = (DECODE, THROUGHPUT, MIXED, FORCED)
DEFAULT_WORKLOAD_KINDS = (DECODE, THROUGHPUT, MIXED)  # the speed workloads; FORCED on request
DEFAULT_BATCHES = (1, 16, 64, 256)
DEFAULT_CONTEXTS = (1024, 8192, 32768)
FIRST_TOKEN_ID = 2  # ids 0 and 1 are the model's bos / eos
# A prefill chunk no engine goes below by default: bounds how many steps prefill can take when sizing the engine.
MIN_PREFILL_CHUNK = 2048


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


class _Named:
    """A workload's ``name``: its class's ``label`` filled with its fields, context lengths as ``4k``."""

    label: ClassVar[str]

    @property
    def name(self) -> str:
        fields = dataclasses.asdict(self)
        return self.label.format(**{k: context_label(v) if k.endswith("context") else v for k, v in fields.items()})


@dataclass(frozen=True)
class DecodeCell(_Named):
    """``batch`` requests of ``context`` prompt tokens, prefilled once; then decode steps of the whole batch are
    timed (TPOT), in windows of :attr:`MeasurePlan.window_steps` steps, one window per repeat."""

    batch: int
    context: int
    kind: str = DECODE
    label: ClassVar[str] = "decode b{batch} {context}"


@dataclass(frozen=True)
class ThroughputLoad(_Named):
    """Offline throughput, decode-heavy: all prompts submitted at once, each generating ``output_len`` tokens
    (ignore_eos); output tokens per second of the whole generate call, once per repeat."""

    prompts: int = 256
    input_len: int = 128
    output_len: int = 512
    kind: str = THROUGHPUT
    label: ClassVar[str] = "throughput {prompts}x{input_len}/{output_len}"


@dataclass(frozen=True)
class MixedLoad(_Named):
    """Chunked prefill under decode: ``decoders`` requests decode while ``long_prompts`` prompts of
    ``long_context`` tokens arrive, one every ``arrival_gap_steps`` decode steps. Timed from the first arrival to the
    last long prompt's first token: the decoders' TPOT, the long prompts' TTFT and output tokens per second."""

    decoders: int = 64
    decoder_context: int = 1024
    long_prompts: int = 8
    long_context: int = 16384
    arrival_gap_steps: int = 16
    kind: str = MIXED
    label: ClassVar[str] = "mixed {decoders}x{decoder_context} + {long_prompts}x{long_context}"


@dataclass(frozen=True)
class ForcedDecode(_Named):
    """Teacher-forced agreement: ``prompts`` requests of ``context`` prompt tokens decode ``steps`` tokens each, every
    step made to emit a scripted random token (the same script for every backend), in the engine's served decode path
    (CUDA graphs included). What each step records is the model's own argmax before the forcing; the driver compares
    these between backends (``agreement.py``). Not timed."""

    prompts: int = 32
    context: int = 1024
    steps: int = 64
    kind: str = FORCED
    label: ClassVar[str] = "forced {prompts}x{context}/{steps}"


Workload = DecodeCell | ThroughputLoad | MixedLoad | ForcedDecode
_CLASSES = {DECODE: DecodeCell, THROUGHPUT: ThroughputLoad, MIXED: MixedLoad, FORCED: ForcedDecode}


@dataclass(frozen=True)
class MeasurePlan:
    """How many decode steps each measurement takes (the same for every backend)."""

    repeats: int = 3
    warmup_steps: int = 8  # decode steps of the full batch before the first timed window
    window_steps: int = 32  # decode steps per timed window (one window per repeat)
    profile_steps: int = 5  # decode steps under torch.profiler after the windows (0: no profile)
    long_prompt_tokens: int = 4  # tokens each long prompt of the mixed load generates (its TTFT is what counts)
    seed: int = 0

    def decode_steps(self) -> int:
        """Decode steps of the full batch a decode cell needs after its prefill."""
        return self.warmup_steps + self.repeats * self.window_steps + self.profile_steps


def prefill_steps_bound(prompt_tokens: int, requests: int, chunk_tokens: int) -> int:
    """Most engine steps the prefill of ``requests`` prompts can take when each step prefills at least
    ``chunk_tokens`` minus one token per running request (what an engine that mixes decodes into prefill steps
    leaves). Early requests decode during those steps, so they need that many extra tokens before the batch is full."""
    per_step = max(chunk_tokens - requests, chunk_tokens // 2)
    return math.ceil(prompt_tokens / per_step) + 1


# Extra tokens beyond what a measurement reads, so that no request finishes inside it (they are aborted at the end).
SLACK_TOKENS = 16


def decode_max_tokens(cell: DecodeCell, plan: MeasurePlan, chunk_tokens: int = MIN_PREFILL_CHUNK) -> int:
    """``max_tokens`` of a decode cell's requests: the early ones decode while later ones prefill, then every request
    runs the warm-up, the windows and the profiled steps."""
    stagger = prefill_steps_bound(cell.batch * cell.context, cell.batch, chunk_tokens)
    return stagger + plan.decode_steps() + SLACK_TOKENS


def mixed_decoder_max_tokens(load: MixedLoad, plan: MeasurePlan, chunk_tokens: int = MIN_PREFILL_CHUNK) -> int:
    """``max_tokens`` of the mixed load's decoders: their own staggered prefill, the warm-up, the arrivals and the
    long prompts' prefill."""
    own = prefill_steps_bound(load.decoders * load.decoder_context, load.decoders, chunk_tokens)
    arrivals = load.long_prompts * load.arrival_gap_steps
    long_prefill = prefill_steps_bound(load.long_prompts * load.long_context, load.decoders, chunk_tokens)
    return own + plan.warmup_steps + arrivals + long_prefill + SLACK_TOKENS


def kv_tokens_needed(workload: Workload, plan: MeasurePlan, chunk_tokens: int = MIN_PREFILL_CHUNK) -> int:
    """KV-cache tokens the workload holds at its peak (prompts plus every token requested)."""
    if isinstance(workload, DecodeCell):
        return workload.batch * (workload.context + decode_max_tokens(workload, plan, chunk_tokens))
    if isinstance(workload, ThroughputLoad):
        return workload.prompts * (workload.input_len + workload.output_len)
    if isinstance(workload, ForcedDecode):
        return workload.prompts * (workload.context + workload.steps)
    decoders = workload.decoders * (workload.decoder_context + mixed_decoder_max_tokens(workload, plan, chunk_tokens))
    return decoders + workload.long_prompts * (workload.long_context + plan.long_prompt_tokens)


def longest_request(workload: Workload, plan: MeasurePlan) -> int:
    """Prompt plus generated tokens of the workload's longest request (what max_model_len must hold)."""
    if isinstance(workload, DecodeCell):
        return workload.context + decode_max_tokens(workload, plan)
    if isinstance(workload, ThroughputLoad):
        return workload.input_len + workload.output_len
    if isinstance(workload, ForcedDecode):
        return workload.context + workload.steps
    return max(workload.decoder_context + mixed_decoder_max_tokens(workload, plan),
               workload.long_context + plan.long_prompt_tokens)


def most_requests(workload: Workload) -> int:
    """Requests the workload runs at once (what max_num_seqs must admit)."""
    if isinstance(workload, DecodeCell):
        return workload.batch
    if isinstance(workload, (ThroughputLoad, ForcedDecode)):
        return workload.prompts
    return workload.decoders + workload.long_prompts


def build_workloads(kinds=DEFAULT_WORKLOAD_KINDS, batches=DEFAULT_BATCHES, contexts=DEFAULT_CONTEXTS,
                    throughput: ThroughputLoad | None = None, mixed: MixedLoad | None = None,
                    forced: ForcedDecode | None = None) -> list[Workload]:
    """The workloads in the order they run: the forced check first (short, and what a correctness run needs), then
    decode cells by batch then context, then throughput, then mixed."""
    unknown = [k for k in kinds if k not in WORKLOAD_KINDS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOAD_KINDS)}")
    workloads: list[Workload] = []
    if FORCED in kinds:
        workloads.append(forced or ForcedDecode())
    if DECODE in kinds:
        workloads += [DecodeCell(b, c) for b in sorted(set(batches)) for c in sorted(set(contexts))]
    if THROUGHPUT in kinds:
        workloads.append(throughput or ThroughputLoad())
    if MIXED in kinds:
        workloads.append(mixed or MixedLoad())
    return workloads


def workload_to_dict(workload: Workload) -> dict:
    return dataclasses.asdict(workload)


def workload_from_dict(data: dict) -> Workload:
    fields = dict(data)
    return _CLASSES[fields.pop("kind")](**fields)


def token_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids in [2, vocab_size), the same for the same arguments (torch's
    CPU generator: millions of ids in well under a second)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN_ID, vocab_size, (count, length), generator=generator).tolist()


def prompt_seed(workload: Workload, plan: MeasurePlan, part: int = 0) -> int:
    """A seed per workload (and per part of it), so that different workloads do not share prompts (no prefix
    reuse is possible even where an engine caches prefixes)."""
    key = f"{workload.name}/{part}/{plan.seed}"
    return sum((i + 1) * ord(ch) for i, ch in enumerate(key)) % (2**31)
