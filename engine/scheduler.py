"""Continuous batching with chunked prefill: which tokens run in the next step (pure policy).

Decoding sequences go first (one token each: they are what inter-token latency waits on), then
sequences part-way through their prompt, then new requests in arrival order while there are free
sequence slots. Each prompt contributes at most ``prefill_chunk_tokens`` per step and the step at
most ``max_batch_tokens`` in all, so a long prompt never stalls the decoders for a whole prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.config import SchedulerConfig


class SeqView(Protocol):
    seq_id: int
    prompt_len: int
    n_prefilled: int

    @property
    def decoding(self) -> bool: ...


@dataclass(frozen=True)
class StepPlan:
    decode: list[int]  # seq ids that decode one token
    prefill: list[tuple[int, int]]  # (seq id, tokens of its prompt to prefill now)
    admit: int  # how many waiting requests (from the front of the queue) join this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def plan_step(running: list[SeqView], waiting_prompt_lens: list[int], cfg: SchedulerConfig) -> StepPlan:
    """Decide the next step. ``running`` is in admission order; ``waiting_prompt_lens`` in arrival order."""
    budget = cfg.max_batch_tokens
    decode = [s.seq_id for s in running if s.decoding][:budget]
    budget -= len(decode)
    prefill: list[tuple[int, int]] = []
    for s in running:
        if budget <= 0:
            break
        if not s.decoding:
            n = min(s.prompt_len - s.n_prefilled, cfg.prefill_chunk_tokens, budget)
            if n > 0:
                prefill.append((s.seq_id, n))
                budget -= n
    admit = 0
    free = cfg.max_batch_seqs - len(running)
    for plen in waiting_prompt_lens:
        if budget <= 0 or admit >= free:
            break
        n = min(plen, cfg.prefill_chunk_tokens, budget)
        prefill.append((-(admit + 1), n))  # negative ids: the admit-th waiting request
        budget -= n
        admit += 1
    return StepPlan(decode, prefill, admit)
