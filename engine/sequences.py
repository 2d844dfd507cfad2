"""Sequences, KV cache slots and the layout of each step: the bookkeeping both backends share.

:class:`SequenceTable` admits requests, asks the scheduler (:func:`engine.scheduler.plan_step`)
which tokens run next, lays them out as one flat step (decode tokens first, in slot order, then
prompt chunks) and, once the step's next tokens are known, appends them and retires finished
sequences. The live engine runs the layout through the model; a backend without tensors routes it
from a router trace. No torch here.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from engine.config import SchedulerConfig
from engine.scheduler import plan_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling (the OpenAI API's fields); a field left None takes the engine config's
    ``sampling`` knob. ``seed`` gives the request its own random stream."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None


@dataclass
class Sequence:
    seq_id: int
    key: str  # the caller's request id
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    n_prefilled: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    sampling: SamplingParams | None = None  # None: the engine config's sampling knobs
    generator: Any = None  # the request's own random stream (a seeded request; a torch.Generator live)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def decoding(self) -> bool:
        return self.n_prefilled >= len(self.prompt)

    @property
    def cached_len(self) -> int:
        """Tokens whose keys and values are in the cache."""
        return self.n_prefilled + max(0, len(self.output) - 1)


@dataclass
class Segment:
    """A run of consecutive tokens of one sequence inside the step."""

    slot: int  # KV cache slot of the sequence
    start: int  # offset in the step's flattened tokens
    n_tokens: int
    past_len: int  # tokens of this sequence already in the cache
    wants_logits: bool  # last token's logits are needed (end of prompt, or decode)


@dataclass
class StepOutcome:
    """What one step did: timing, batch shape, and the tokens it produced per request key."""

    duration_s: float
    batch_seqs: int
    prefill_tokens: int
    decode_tokens: int
    tokens: list[tuple[str, int]]  # (request key, token id) in step order
    finished: list[Sequence]
    ep: dict[str, Any] | None = None
    """Under expert parallelism: this step's bytes dispatched and combined and its load imbalance
    (:meth:`engine.moe.policy.placement.EPStats.last_step`); None with one rank."""


@dataclass
class StepLayout:
    """One step's tokens flattened: ids and positions per row, the segments, and who owns what."""

    token_ids: list[int]
    positions: list[int]
    segments: list[Segment]
    owners: list[tuple[str, int, int]]  # (request key, first row, rows) per segment
    sampled: list[Sequence]  # sequences whose next token this step produces, in row order
    prefill_tokens: int
    decode_tokens: int

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def batch_seqs(self) -> int:
        return len({s.slot for s in self.segments})


class SequenceTable:
    """The sequences one backend serves: waiting, running (each in a KV cache slot), finished."""

    def __init__(self, scheduler: SchedulerConfig, vocab_size: int) -> None:
        self.cfg = scheduler
        self.vocab_size = vocab_size
        self.free_slots = list(range(scheduler.max_batch_seqs))
        heapq.heapify(self.free_slots)
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self._next_id = 0

    def add(self, key: str, prompt: list[int], max_new_tokens: int,
            sampling: SamplingParams | None = None) -> Sequence:
        """Queue a request (``sampling`` overrides the config's sampling knobs for it); one that cannot
        fit ``max_seq_len_tokens`` comes back ``rejected``."""
        if not prompt:
            raise ValueError(f"request {key}: empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {key}: token id {bad[0]} outside the vocabulary of {self.vocab_size}")
        seq = Sequence(self._next_id, key, list(prompt), max_new_tokens)
        if sampling is not None and sampling != SamplingParams():
            seq.sampling = sampling
        self._next_id += 1
        if len(prompt) + max_new_tokens > self.cfg.max_seq_len_tokens:
            seq.finish_reason = "rejected"
            log.warning("request %s: %d prompt + %d new tokens exceed max_seq_len_tokens=%d; rejected", key,
                        len(prompt), max_new_tokens, self.cfg.max_seq_len_tokens)
            return seq
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def abort(self, key: str) -> Sequence | None:
        """Drop the waiting or running sequence of request ``key`` (its slot is freed); None if absent."""
        for seq in self.waiting:
            if seq.key == key:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.key == key:
                self.running.remove(seq)
                heapq.heappush(self.free_slots, seq.slot)
                seq.finish_reason = "abort"
                return seq
        return None

    def next_step(self) -> StepLayout:
        """Admit what the scheduler lets in and lay out the step's tokens (empty when nothing runs)."""
        # Only the first free-slot count of waiting requests can be admitted: a long queue (a whole
        # offline workload) is not walked every step.
        free = max(0, self.cfg.max_batch_seqs - len(self.running))
        plan = plan_step(self.running, [s.prompt_len for s in itertools.islice(self.waiting, free)], self.cfg)
        for _ in range(plan.admit):
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free_slots)
            self.running.append(seq)
        by_id = {s.seq_id: s for s in self.running}
        admitted = self.running[len(self.running) - plan.admit:] if plan.admit else []
        ids: list[int] = []
        pos: list[int] = []
        segments: list[Segment] = []
        sampled: list[Sequence] = []
        owners: list[tuple[str, int, int]] = []
        decode_seqs = [by_id[i] for i in plan.decode]
        # Decode tokens first, in slot order, so their cache rows are often one contiguous view.
        for seq in sorted(decode_seqs, key=lambda s: s.slot):
            p = seq.cached_len
            segments.append(Segment(seq.slot, len(ids), 1, p, True))
            owners.append((seq.key, len(ids), 1))
            ids.append(seq.output[-1])
            pos.append(p)
            sampled.append(seq)
        prefill_tokens = 0
        for sid, n in plan.prefill:
            seq = admitted[-sid - 1] if sid < 0 else by_id[sid]
            start = seq.n_prefilled
            done = start + n >= seq.prompt_len
            segments.append(Segment(seq.slot, len(ids), n, start, done))
            owners.append((seq.key, len(ids), n))
            ids += seq.prompt[start: start + n]
            pos += range(start, start + n)
            seq.n_prefilled += n
            prefill_tokens += n
            if done:
                sampled.append(seq)
        return StepLayout(ids, pos, segments, owners, sampled, prefill_tokens, len(decode_seqs))

    def finish_step(self, layout: StepLayout, next_ids: Seq[int], eos_ids: Collection[int],
                    ignore_eos: bool) -> tuple[list[tuple[str, int]], list[Sequence]]:
        """Append each sampled sequence's next token; retire those at their length or at EOS (unless
        ``ignore_eos``, or the sequence's own sampling says otherwise). Returns the (request key,
        token) pairs in row order and the finished sequences."""
        produced: list[tuple[str, int]] = []
        finished: list[Sequence] = []
        for seq, tok in zip(layout.sampled, next_ids, strict=True):
            seq.output.append(tok)
            produced.append((seq.key, tok))
            ignore = ignore_eos
            if seq.sampling is not None and seq.sampling.ignore_eos is not None:
                ignore = seq.sampling.ignore_eos
            if len(seq.output) >= seq.max_new_tokens:
                seq.finish_reason = "length"
            elif not ignore and tok in eos_ids:
                seq.finish_reason = "eos"
            if seq.finish_reason:
                finished.append(seq)
        if finished:
            done_ids = {s.seq_id for s in finished}
            self.running = [s for s in self.running if s.seq_id not in done_ids]
            for s in finished:
                heapq.heappush(self.free_slots, s.slot)
        return produced, finished
