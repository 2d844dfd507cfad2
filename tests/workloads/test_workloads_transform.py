"""Transforms keep requests and router traces consistent."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.schema import Request, Workload, WorkloadError
from workloads.synth import synth_router_trace
from workloads.transform import apply_transforms, clip_lengths, parse_window, rate_scale, sample, window


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
