"""The sequence bookkeeping both backends share: admission, step layout, finishing, aborts (no torch)."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.sequences import SequenceTable


def table(**kw) -> SequenceTable:
    base = dict(max_batch_seqs=2, max_batch_tokens=8, prefill_chunk_tokens=4, max_seq_len_tokens=32)
    return SequenceTable(SchedulerConfig(**{**base, **kw}), vocab_size=100)


def test_layout_decodes_first_then_chunks_prompts_and_frees_slots():
    t = table()
    a, b, c = t.add("a", [1, 2, 3], 2), t.add("b", [4, 5, 6, 7, 8, 9], 1), t.add("c", [10], 1)
    s1 = t.next_step()  # a whole, b's first chunk; c waits for a slot
    assert s1.owners == [("a", 0, 3), ("b", 3, 4)] and s1.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert s1.positions == [0, 1, 2, 0, 1, 2, 3] and [s.key for s in s1.sampled] == ["a"]
    assert (s1.prefill_tokens, s1.decode_tokens, s1.batch_seqs) == (7, 0, 2)
    produced, finished = t.finish_step(s1, [42], eos_ids=(), ignore_eos=True)
    assert produced == [("a", 42)] and not finished
    s2 = t.next_step()  # a decodes its token first, then the rest of b's prompt
    assert s2.owners == [("a", 0, 1), ("b", 1, 2)] and s2.token_ids[0] == 42 and s2.positions[0] == 3
    produced, finished = t.finish_step(s2, [5, 6], eos_ids=(), ignore_eos=True)
    assert {s.key for s in finished} == {"a", "b"} and a.output == [42, 5] and b.output == [6]
    s3 = t.next_step()  # both slots free again: c runs
    assert s3.owners == [("c", 0, 1)] and c.slot in (0, 1)
    t.finish_step(s3, [7], eos_ids=(), ignore_eos=True)
    assert not t.has_work and t.next_step().segments == []


def test_eos_rejection_and_abort():
    t = table()
    assert t.add("long", list(range(30)), 5).finish_reason == "rejected" and not t.has_work
    x = t.add("x", [1, 2], 5)
    t.finish_step(t.next_step(), [9], eos_ids=(9,), ignore_eos=False)
    assert x.finish_reason == "eos" and not t.has_work
    y, z = t.add("y", [1, 2], 5), t.add("z", [3], 5)
    t.next_step()
    assert t.abort("y") is y and y.finish_reason == "abort" and t.abort("nope") is None
    assert len(t.free_slots) == 1 and [s.key for s in t.running] == ["z"] and z.slot >= 0
    with pytest.raises(ValueError, match="token id 100 outside"):
        t.add("bad", [100], 1)
    with pytest.raises(ValueError, match="empty prompt"):
        t.add("empty", [], 1)
