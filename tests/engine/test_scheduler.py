"""Continuous batching policy: decode first, chunked prefill, token and sequence limits."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.config import SchedulerConfig
from engine.scheduler import plan_step


@dataclass
class S:
    seq_id: int
    prompt_len: int
    n_prefilled: int

    @property
    def decoding(self) -> bool:
        return self.n_prefilled >= self.prompt_len


def cfg(**kw) -> SchedulerConfig:
    base = dict(max_batch_seqs=4, max_batch_tokens=16, prefill_chunk_tokens=8, max_seq_len_tokens=4096)
    return SchedulerConfig(**{**base, **kw})


def test_decoders_first_then_partial_prefill_then_admissions():
    running = [S(0, 5, 5), S(1, 20, 8), S(2, 3, 3)]
    plan = plan_step(running, [10, 4], cfg())
    assert plan.decode == [0, 2]
    # 16 tokens: 2 decode, 8 for the partial prompt, 6 for the first waiting request
    assert plan.prefill == [(1, 8), (-1, 6)]
    assert plan.admit == 1  # the second waiting request would exceed max_batch_seqs=4


def test_long_prompt_is_chunked_over_steps():
    plan = plan_step([], [100], cfg(max_batch_tokens=64, prefill_chunk_tokens=32))
    assert plan.prefill == [(-1, 32)] and plan.admit == 1


def test_token_budget_caps_admissions():
    plan = plan_step([], [8, 8, 8], cfg(max_batch_tokens=16))
    assert plan.admit == 2 and sum(n for _, n in plan.prefill) == 16


@pytest.mark.parametrize("seqs", [1, 2, 4])
def test_never_more_sequences_than_allowed(seqs):
    plan = plan_step([], [1] * 10, cfg(max_batch_seqs=seqs))
    assert plan.admit == seqs


def test_empty():
    assert plan_step([], [], cfg()).empty
