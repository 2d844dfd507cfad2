"""The measurer's pieces that need no engine: the warm-up workload."""

from __future__ import annotations

import numpy as np

from tuner.measure import WARM_UP_NEW_TOKENS, warm_up_workload
from workloads.router import RouterTrace
from workloads.schema import Request, Workload

IDENTITY = {"arch": "qwen3_moe", "n_layers": 2, "n_experts": 4, "top_k": 2, "hidden_size": 8, "moe_layers": [0, 1],
            "fingerprint": "f"}


def _workload(with_trace: bool) -> Workload:
    reqs = [Request("a", 0.0, 5, 20), Request("b", 0.5, 3, 2), Request("c", 1.0, 4, 9)]
    trace = None
    if with_trace:
        lens = [r.prompt_len + r.max_new_tokens for r in reqs]
        n = sum(lens)
        ids = np.arange(n * 2 * 2, dtype=np.int16).reshape(n, 2, 2) % 4
        trace = RouterTrace(IDENTITY, [r.request_id for r in reqs], np.concatenate([[0], np.cumsum(lens)]), ids,
                            np.ones((n, 2, 2), np.float16))
    return Workload("w", reqs, {}, trace)


def test_the_warm_up_runs_the_first_prompts_with_a_few_new_tokens_and_their_routing():
    wl = _workload(with_trace=True)
    short = warm_up_workload(wl, 2)
    assert [(r.request_id, r.prompt_len, r.max_new_tokens) for r in short.requests] == [
        ("a", 5, WARM_UP_NEW_TOKENS), ("b", 3, 2)]
    assert short.router_trace.request_ids == ["a", "b"]
    # Request a's routing is its first prompt + new tokens rows, unchanged.
    assert np.array_equal(short.router_trace.expert_ids[: 5 + WARM_UP_NEW_TOKENS],
                          wl.router_trace.expert_ids[: 5 + WARM_UP_NEW_TOKENS])
    assert short.router_trace.n_tokens == 5 + WARM_UP_NEW_TOKENS + 3 + 2
    assert [r.max_new_tokens for r in wl.requests] == [20, 2, 9]  # the study's workload is untouched
    plain = warm_up_workload(_workload(with_trace=False), 1)
    assert plain.router_trace is None and len(plain.requests) == 1


def test_hotness_is_counted_once_per_study_on_the_start_config_and_survives_reconfiguring(tiny_engine, tiny_workload):
    from engine.config import EngineConfig
    from tuner.measure import Measurer, MeasureSettings
    from tuner.slo import parse_slo

    tiny_engine.reconfigure(EngineConfig())
    tiny_engine.hotness = None
    m = Measurer(tiny_engine, tiny_workload, parse_slo([]), MeasureSettings(("goodput_rps",), "offline"))
    tiny_engine.warm_up_hotness()  # the plain start config places nothing by hotness: no profile
    assert tiny_engine.hotness is None
    assert m.warm_up_hotness() > 0
    profile = tiny_engine.hotness
    assert profile is not None and profile.shape == (len(tiny_engine.spec.moe_layers), tiny_engine.spec.n_experts)
    assert np.allclose(profile.sum(axis=1), 1.0)
    assert m.warm_up_hotness() == 0.0  # once: a later call keeps the profile
    static = EngineConfig().replace(residency="static", resident_budget_gib=0.0)
    m.apply(static)
    assert tiny_engine.hotness is profile  # the static trial plans from it instead of routing its own warm-up
    tiny_engine.reconfigure(EngineConfig())
    tiny_engine.hotness = None


def test_a_probe_faster_than_the_workload_replays_it_cycled_to_a_minimum_span(tiny_engine, tiny_workload, monkeypatch):
    """Where the workload's requests arrive within less than MIN_PROBE_S at a probe's rate, the probe replays
    copies of them (one period later) until they span that long, and its row counts them; the search's
    highest rate is MAX_PROBE_REQUESTS arriving over MIN_PROBE_S, and a config that meets the target there
    is reported as beyond what the search can show."""
    import math

    import pytest

    from engine.config import EngineConfig
    from tuner import measure
    from tuner.measure import Measurer, MeasureSettings
    from tuner.slo import parse_slo

    monkeypatch.setattr(measure, "MIN_PROBE_S", 0.5)
    monkeypatch.setattr(measure, "MAX_PROBE_REQUESTS", 40)
    tiny_engine.reconfigure(EngineConfig())
    slo = parse_slo(["ttft_p99_ms=600000", "tpot_p99_ms=600000"])  # met at any rate: the search climbs to the top
    m = Measurer(tiny_engine, tiny_workload, slo, MeasureSettings(("capacity_rps",), "realtime"))
    n = len(tiny_workload.requests)
    got = m.measure(1.0)
    assert not got.capacity.bounded and got.values[0] == pytest.approx(39 / 0.5)
    assert "the highest rate a probe replays (40 requests over 0.5 s)" in got.reason
    rows = [r.row() for r in got.replays]
    for r, row in zip(got.replays, rows, strict=True):
        cycled = (n - 1) / r.rate_rps < 0.5  # the workload's own arrivals span less than the minimum
        assert row["n_requests"] == (min(40, math.ceil(0.5 * r.rate_rps) + 1) if cycled else n), row
        assert r.prefix_n == n
        ids = {q.request_id for q in r.result.requests}
        assert any("~cycle" in i for i in ids) == (cycled and len(ids) > n)
    assert rows[-1]["n_requests"] == 40 and max(len(r.result.requests) for r in got.replays) > n
    assert got.replays[-1].met
    monkeypatch.setattr(measure, "MAX_PROBE_REQUESTS", n - 2)  # a workload longer than the cap is never cut
    assert m._replayed(1000.0, n, 0.5) == (tiny_workload, n)
