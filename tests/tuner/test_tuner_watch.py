"""The SLO watch through the runner's ``on_progress``: a replay stops once its verdict is certain,
returns what it measured, and leaves the backend idle for the next replay (the real tiny model)."""

from __future__ import annotations

import pytest

from engine.backend import as_backend
from engine.runner import run_workload
from tuner.slo import evaluate, parse_slo
from tuner.watch import SloWatch


def _watch(workload, slo, **kw) -> SloWatch:
    return SloWatch({r.request_id: r.max_new_tokens for r in workload.requests}, slo, every_s=0.0, **kw)


@pytest.mark.parametrize("case", ["missed", "met"])
def test_a_watched_replay_stops_at_its_verdict_and_the_backend_is_idle_after(tiny_engine, tiny_workload, case):
    backend = as_backend(tiny_engine)
    n = len(tiny_workload.requests)
    if case == "missed":  # no request can get its first token within a microsecond
        slo = parse_slo(["ttft_p99_ms=0.001"])
    else:  # a bound every request meets, and a target the first finished requests reach
        slo = parse_slo(["ttft_p99_ms=600000", "attainment_min=0.3"])
    watch = _watch(tiny_workload, slo, stop_when_met=case == "met")
    # Arrivals spread out (rate scale 0.25), so the verdict comes before the last request.
    result = run_workload(backend, tiny_workload, mode="realtime", rate_scale=0.25, on_progress=watch)
    assert watch.decision == case and "stopped after" in watch.reason
    unfinished = [r for r in result.requests if not r.finish_reason]
    assert unfinished and len(result.requests) == n  # stopped early: the rest were never finished
    assert not backend.has_work  # the runner aborted them on the backend
    got = evaluate(result.requests, result.summary(), result.duration_s, slo, [])
    if case == "missed":
        assert got.attainment < slo.attainment_target  # the final figures agree with the verdict
    else:
        assert got.attainment >= slo.attainment_target
    # The next replay starts from an idle backend and runs to the end.
    full = run_workload(backend, tiny_workload, mode="offline")
    assert all(r.finish_reason in ("length", "eos") for r in full.requests)


def test_an_unwatched_or_disabled_watch_never_stops(tiny_engine, tiny_workload):
    watch = _watch(tiny_workload, parse_slo(["quality_min=0.9"]))  # no latency bound: nothing to watch
    assert not watch.enabled
    result = run_workload(as_backend(tiny_engine), tiny_workload, mode="offline", on_progress=watch)
    assert watch.decision is None and all(r.finish_reason for r in result.requests)
