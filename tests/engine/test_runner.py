"""Workload replay: metric definitions, continuous batching, arrivals, expert stats, router traces."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.model.maker import make_model
from engine.runner import popularity, record_router_trace, run_workload
from engine.runtime import Engine
from workloads import Request, Workload, WorkloadError, load_workload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("runner-model")
    make_model(d, "qwen3_moe", "tiny", seed=3, dtype="float32")
    return str(d)


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine(model_dir, EngineConfig().replace(max_batch_seqs=4, max_batch_tokens=64, prefill_chunk_tokens=16))


def small_workload(n=10, gap_s=0.05, prompt=(5, 40), out=(2, 9)) -> Workload:
    rng = np.random.default_rng(0)
    reqs = [Request(f"r{i}", i * gap_s, int(rng.integers(*prompt)), int(rng.integers(*out))) for i in range(n)]
    return Workload("test", reqs, {"source": "test"})


def test_offline_run_measures_every_request_by_the_definitions(engine):
    wl = small_workload()
    res = run_workload(engine, wl, mode="offline")
    assert len(res.requests) == len(wl.requests)
    by_id = {r.request_id: r for r in wl.requests}
    for r in res.requests:
        assert r.arrival_s == 0.0  # offline: everything arrives at once
        assert r.output_tokens == by_id[r.request_id].max_new_tokens == len(r.output_ids)
        assert r.finish_reason == "length"
        assert len(r.itl_ms) == r.output_tokens - 1
        assert r.ttft_ms == pytest.approx((r.first_token_s - r.arrival_s) * 1e3)
        if r.output_tokens > 1:
            # TPOT excludes the first token: the mean of the inter-token gaps
            assert r.tpot_ms == pytest.approx(sum(r.itl_ms) / len(r.itl_ms), rel=1e-6)
        assert r.e2e_ms >= r.ttft_ms
    s = res.summary()
    assert s["output_tokens"] == sum(r.max_new_tokens for r in wl.requests)
    assert s["output_tokens_per_s"] == pytest.approx(s["output_tokens"] / res.duration_s)
    assert s["ttft_p50_ms"] <= s["ttft_p99_ms"]
    # steps: never more sequences or tokens than the scheduler allows
    cfg = engine.config.scheduler
    assert all(st.batch_seqs <= cfg.max_batch_seqs for st in res.steps)
    assert all(st.prefill_tokens + st.decode_tokens <= cfg.max_batch_tokens for st in res.steps)
    assert sum(st.prefill_tokens for st in res.steps) == sum(r.prompt_len for r in wl.requests)
    # continuous batching: some step mixes prefill of one request with decode of others
    assert any(st.prefill_tokens and st.decode_tokens for st in res.steps)
    # every processed token was routed to top_k experts in each MoE layer
    processed = sum(r.prompt_len + r.max_new_tokens - 1 for r in wl.requests)
    spec = engine.spec
    for layer in spec.moe_layers:
        assert sum(e.tokens for e in res.expert_stats if e.layer == layer) == processed * spec.top_k
    assert res.telemetry and res.peak_rss_bytes > 0
    assert [p["layer"] for p in popularity(res)] == list(spec.moe_layers)


def test_batched_outputs_equal_one_request_at_a_time(engine, model_dir):
    wl = small_workload(n=6)
    batched = run_workload(engine, wl, mode="offline")
    alone = Engine(model_dir, EngineConfig().replace(max_batch_seqs=1, max_batch_tokens=64, prefill_chunk_tokens=64))
    single = run_workload(alone, wl, mode="offline")
    assert [r.output_ids for r in batched.requests] == [r.output_ids for r in single.requests]


def test_realtime_respects_arrivals(engine):
    """No request is computed before it arrives (arrival times divided by the rate scale), and each is
    served as it arrives rather than after the whole workload."""
    wl = small_workload(n=4, gap_s=0.6)
    res = run_workload(engine, wl, mode="realtime", rate_scale=2.0)
    starts = [s.start_s for s in res.steps]
    for r, req in zip(res.requests, wl.requests, strict=True):
        assert r.arrival_s == pytest.approx(req.arrival_s / 2.0)
        first_step = max(t for t in starts if t <= r.first_token_s)  # the step that made its first token
        assert first_step >= r.arrival_s - 1e-9, (first_step, r.arrival_s)
    # Served on arrival: the tiny model's first token comes long before the next request arrives (0.3 s).
    for r, nxt in zip(res.requests, res.requests[1:], strict=False):
        assert r.first_token_s < nxt.arrival_s
    assert res.duration_s >= wl.requests[-1].arrival_s / 2.0


def test_too_long_requests_are_rejected_not_fatal(model_dir):
    eng = Engine(model_dir, EngineConfig().replace(max_seq_len_tokens=32, max_batch_tokens=64))
    wl = Workload("t", [Request("ok", 0.0, 8, 4), Request("long", 0.0, 40, 4)], {})
    res = run_workload(eng, wl, mode="offline")
    by = {r.request_id: r for r in res.requests}
    assert by["long"].finish_reason == "rejected" and by["ok"].output_tokens == 4
    assert res.summary()["requests_rejected"] == 1


def test_recorded_router_trace_replays_the_models_expert_choices(model_dir, engine):
    wl = small_workload(n=3)
    trace = record_router_trace(model_dir, wl)
    spec = engine.spec
    for req in wl.requests:
        ids, gates = trace.request(req.request_id)
        assert ids.shape == (req.prompt_len + req.max_new_tokens - 1, len(spec.moe_layers), spec.top_k)
    # replay: the same request run alone through a fresh engine routes its tokens identically
    again = record_router_trace(model_dir, Workload("one", [wl.requests[1]], {}))
    a_ids, a_w = again.request(wl.requests[1].request_id)
    b_ids, b_w = trace.request(wl.requests[1].request_id)
    np.testing.assert_array_equal(np.sort(a_ids, -1), np.sort(b_ids, -1))
    np.testing.assert_allclose(np.sort(a_w.astype(np.float32), -1), np.sort(b_w.astype(np.float32), -1), atol=1e-3)


def test_a_trace_from_another_model_is_refused(model_dir, tmp_path):
    wl = small_workload(n=2).with_router_trace(record_router_trace(model_dir, small_workload(n=2)))
    other = tmp_path / "other"
    make_model(other, "qwen3_moe", "tiny", seed=99, dtype="float32")
    with pytest.raises(WorkloadError, match="fingerprint"):
        run_workload(Engine(str(other)), wl, mode="offline")


def test_builtin_workload_runs(engine):
    wl = load_workload("builtin:tiny")
    res = run_workload(engine, wl, mode="offline", max_requests=5)
    assert res.summary()["requests_done"] == 5
