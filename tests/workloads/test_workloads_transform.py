"""Transforms keep requests and router traces consistent."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.schema import Request, Workload, WorkloadError
from workloads.synth import synth_router_trace
from workloads.transform import (
    apply_transforms,
    clip_lengths,
    cycle,
    is_copy,
    parse_window,
    rate_scale,
    sample,
    window,
)


def _workload() -> Workload:
    requests = [Request(f"r{i}", float(i), 10 + i, 5, prompt_ids=tuple(range(10 + i)) if i == 3 else None,
                        hash_ids=(1,) if i == 4 else None) for i in range(10)]
    w = Workload("w", requests, {"source": "test"})
    return w.with_router_trace(synth_router_trace(w.requests, n_layers=2, n_experts=4, top_k=2))


def test_rate_scale():
    w = rate_scale(_workload(), 2.0)
    assert w.duration_s == 4.5 and w.rate_per_s == pytest.approx(2.0)
    assert w.router_trace.n_tokens == _workload().router_trace.n_tokens
    assert w.metadata["transforms"] == [{"rate_scale": 2.0}]
    with pytest.raises(WorkloadError):
        rate_scale(_workload(), 0)


def test_window():
    w = window(_workload(), *parse_window("2:5"))
    assert [r.request_id for r in w] == ["r2", "r3", "r4"] and [r.arrival_s for r in w] == [0.0, 1.0, 2.0]
    assert w.router_trace.request_ids == ["r2", "r3", "r4"]
    assert parse_window("3:") == (3.0, float("inf"))
    for bad in ("5:2", "a:b", "7"):
        with pytest.raises(WorkloadError):
            parse_window(bad)
    with pytest.raises(WorkloadError, match="no request"):
        window(_workload(), 100, 200)


def test_sample_seeded():
    a, b = sample(_workload(), 4, seed=1), sample(_workload(), 4, seed=1)
    assert a.requests == b.requests and len(a) == 4
    assert a.router_trace.request_ids == [r.request_id for r in a]
    assert sample(_workload(), 4, seed=2).requests != a.requests


def test_clip_keeps_trace_consistent():
    original = _workload()
    w = clip_lengths(original, max_prompt_len=12, max_output_len=3)
    assert w.prompt_lens.max() == 12 and w.output_lens.max() == 3
    assert w.request("r3").prompt_ids == tuple(range(12))
    trace = w.router_trace
    assert trace.request_ids == ["r0", "r1", "r2"]  # prompts of r3.. were clipped: their routing is unknown
    assert trace.tokens_per_request() == {"r0": 12, "r1": 13, "r2": 14}  # prompt + 3 - 1
    np.testing.assert_array_equal(trace.request("r1")[0], original.router_trace.request("r1")[0][:13])
    step = w.metadata["transforms"][-1]
    assert step["clipped_prompts"] == 7 and step["clipped_outputs"] == 10


def test_apply_order():
    w = apply_transforms(_workload(), window_s=(2, 8), sample_n=3, seed=0, rate_scale_factor=0.5)
    assert len(w) == 3 and all(r.arrival_s <= 12 for r in w)
    assert [list(step) for step in w.metadata["transforms"]] == [["window_s"], ["sample", "seed"], ["rate_scale"]]


def test_cycle_repeats_requests_at_the_workloads_rate_with_their_routing():
    original = _workload()  # 10 requests, one a second
    hashed = original.with_requests([Request(r.request_id, r.arrival_s, r.prompt_len, r.max_new_tokens,
                                             r.prompt_ids, hash_ids=(i % 3 + 7 * (i == 3),) if i % 2 else None)
                                     for i, r in enumerate(original.requests)])
    w = cycle(hashed, 25)
    assert len(w) == 25 and w.metadata["transforms"][-1] == {"cycle": 25}
    ids = [r.request_id for r in w.requests]
    assert ids[:10] == [r.request_id for r in original.requests] and ids[10] == "r0~cycle1" and ids[24] == "r4~cycle2"
    gaps = np.diff(w.arrivals_s)
    np.testing.assert_allclose(gaps, 1.0, atol=1e-6)  # the copies continue the arrivals at the same rate
    copy, orig = w.request("r3~cycle2"), w.request("r3")
    assert (copy.prompt_len, copy.max_new_tokens, copy.prompt_ids) == (orig.prompt_len, orig.max_new_tokens,
                                                                       orig.prompt_ids)
    assert orig.hash_ids == (7,) and copy.hash_ids == (7 + 16,)  # renamed blocks: no prefix shared with r3
    assert not set(copy.hash_ids) & {h for r in w.requests[:10] if r.hash_ids for h in r.hash_ids}
    assert [is_copy(i) for i in ids] == [False] * 10 + [True] * 15
    assert w.router_trace.request_ids == ids  # every copy has its original's routing
    for rid in ("r3~cycle2", "r9~cycle1"):
        a, b = w.router_trace.request(rid), original.router_trace.request(rid.split("~")[0])
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
    assert [r.request_id for r in cycle(original, 4).requests] == ["r0", "r1", "r2", "r3"]  # fewer: a prefix
    burst = original.with_requests([Request(f"b{i}", 1.0, 4, 2) for i in range(3)])  # all at once: copies too
    assert list(cycle(burst, 7).arrivals_s) == [1.0] * 7
    with pytest.raises(WorkloadError, match="cycle: 0 is less than 1"):
        cycle(original, 0)
