"""SLO specs, per-request attainment, goodput, early stopping, capacity and objectives (pure code)."""

from __future__ import annotations

import json
import math

import pytest

from engine.results import RequestResult, RunResult
from tuner.metrics import (
    ObjectiveError,
    gain,
    objective_values,
    pareto_ranks,
    parse_objectives,
    trial_metrics,
)
from tuner.slo import (
    DEFAULT_ATTAINMENT,
    SLO_METRICS,
    Progress,
    SloError,
    certain_meets,
    certain_misses,
    evaluate,
    parse_slo,
    request_meets,
    study_constraints,
    target_certain,
    target_unreachable,
)
from tuner.study import parse_duration


def _req(rid: str, arrival_s: float, first_s: float | None, finish_s: float | None, out: int,
         reason: str = "length") -> RequestResult:
    return RequestResult(rid, arrival_s, 16, out, first_s, finish_s, [], reason)


# ttft 100 ms, tpot (0.6-0.1)/5 = 100 ms, e2e 600 ms
FAST = _req("fast", 0.0, 0.1, 0.6, 6)
# ttft 1500 ms: misses a 1000 ms TTFT bound
SLOW_START = _req("slow-start", 0.5, 2.0, 2.5, 6)
# ttft 100 ms, tpot (2.1-0.1)/4 = 500 ms: misses a 200 ms TPOT bound
SLOW_DECODE = _req("slow-decode", 1.0, 1.1, 3.1, 5)
# one token: no TPOT, cannot break a TPOT bound
ONE_TOKEN = _req("one", 1.5, 1.6, 1.6, 1)
REJECTED = _req("rejected", 2.0, None, None, 0, "rejected")
REQUESTS = [FAST, SLOW_START, SLOW_DECODE, ONE_TOKEN, REJECTED]


def test_parse_entries_files_and_aliases(tmp_path):
    slo = parse_slo(["ttft_p99_ms=2000", "tpot_p99_ms=200", "quality_min=0.95", "throughput_min=10"])
    assert slo.bounds == {"ttft_p99_ms": 2000.0, "tpot_p99_ms": 200.0, "quality_min": 0.95,
                          "output_tokens_per_s_min": 10.0}
    assert slo.request_limits_ms() == {"ttft_ms": 2000.0, "tpot_ms": 200.0}
    assert slo.attainment_target == DEFAULT_ATTAINMENT
    f = tmp_path / "slo.json"
    f.write_text(json.dumps({"ttft_p50_ms": 500, "ttft_p99_ms": 3000, "attainment_min": 0.8}))
    from_file = parse_slo([str(f), "e2e_p90_ms=9000"])
    assert from_file.request_limits_ms() == {"ttft_ms": 3000.0, "e2e_ms": 9000.0}  # the loosest bound
    assert from_file.attainment_target == 0.8
    assert parse_slo([]).attainment_target is None and parse_slo([]).constraint_names() == []
    assert "ttft_p99_ms<=2000" in slo.describe() and "attainment>=0.9" in slo.describe()
    # An exported config file carries its SLO: reuse it.
    export = tmp_path / "best.json"
    export.write_text(json.dumps({"engine_config": {}, "slo": {"tpot_p90_ms": 150}}))
    assert parse_slo([str(export)]).bounds == {"tpot_p90_ms": 150.0}
    # Every latency metric at every percentile is in the table.
    assert {f"{m}_p{q}_ms" for m in ("ttft", "tpot", "e2e", "itl") for q in (50, 90, 99)} <= set(SLO_METRICS)


@pytest.mark.parametrize("entry, words", [
    ("ttft_p99=2000", ["ttft_p99=2000", "unknown SLO metric", "ttft_p99_ms"]),
    ("latency_ms=5", ["latency_ms", "known:"]),
    ("ttft_p99_ms=fast", ["'fast'", "not a number"]),
    ("tpot_p99_ms=-1", ["must be a finite number > 0"]),
    ("tpot_p99_ms=inf", ["finite"]),
    ("quality_min=95", ["quality_min", "between 0 and 1"]),
    ("no-such-file.json", ["NAME=VALUE"]),
])
def test_bad_slo_entries_are_one_line_errors_naming_the_entry(entry, words):
    with pytest.raises(SloError) as e:
        parse_slo([entry])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_bad_slo_files_and_repeats(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for entries, word in [([str(bad)], "not valid JSON"), (["ttft_p99_ms=1", "ttft_p99_ms=2"], "twice")]:
        with pytest.raises(SloError, match=word):
            parse_slo(entries)
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(SloError, match="JSON object"):
        parse_slo([str(arr)])


def test_request_meets_every_per_request_bound():
    limits = {"ttft_ms": 1000.0, "tpot_ms": 200.0}
    assert [request_meets(r, limits) for r in REQUESTS] == [True, False, False, True, False]
    assert request_meets(SLOW_DECODE, {"ttft_ms": 1000.0})
    assert request_meets(SLOW_START, {"e2e_ms": 2000.0})  # e2e 2000 ms: on the bound is met
    assert not request_meets(SLOW_START, {"e2e_ms": 1999.0})
    assert not request_meets(_req("unfinished", 0, 0.1, None, 3, ""), {})


def test_attainment_goodput_and_constraints_on_hand_made_requests():
    result = RunResult(meta={}, requests=REQUESTS, steps=[], telemetry=[], expert_stats=[], duration_s=4.0,
                       peak_rss_bytes=0)
    summary = result.summary()
    slo = parse_slo(["ttft_p99_ms=1000", "tpot_p99_ms=200", "quality_min=0.9"])
    r = evaluate(result.requests, summary, result.duration_s, slo)
    assert r.met == {"fast": True, "slow-start": False, "slow-decode": False, "one": True, "rejected": False}
    assert r.attainment == pytest.approx(2 / 5)
    assert r.goodput_rps == pytest.approx(2 / 4.0)
    assert r.goodput_tokens_per_s == pytest.approx((6 + 1) / 4.0)
    assert r.constraints["attainment_min"] == pytest.approx(1 - 0.4 / 0.9)
    assert r.constraints["ttft_p99_ms"] == pytest.approx(summary["ttft_p99_ms"] / 1000 - 1)
    assert r.constraints["ttft_p99_ms"] > 0 and r.constraints["tpot_p99_ms"] > 0
    assert r.unmeasured == ["quality_min"] and r.constraints["quality_min"] == 0.0
    assert not r.feasible and set(r.violated()) == {"attainment_min", "ttft_p99_ms", "tpot_p99_ms"}
    loose = evaluate(result.requests, summary, 4.0, parse_slo(["ttft_p99_ms=5000", "attainment_min=0.5"]))
    assert loose.attainment == pytest.approx(4 / 5) and loose.feasible  # all but the rejected one
    # Nothing finished: latency percentiles are missing, which violates their bounds.
    none = evaluate([REJECTED], {"ttft_p99_ms": None, "tpot_p99_ms": None}, 1.0, slo)
    assert none.attainment == 0 and none.constraints["ttft_p99_ms"] == 1.0 and not none.feasible


def test_certain_misses_use_lower_bounds_only():
    limits = {"ttft_ms": 1000.0, "tpot_ms": 200.0}
    progress = [
        Progress(0.0, first_token_s=0.1, finish_s=0.6, output_tokens=6),  # met
        Progress(0.0, first_token_s=1.5),  # first token after 1.5 s: missed
        Progress(0.2),  # waiting since 0.2 s; at now=1.0 s that is 0.8 s: not yet missed
        Progress(0.0, first_token_s=0.1, finish_s=2.1, output_tokens=5),  # tpot 500 ms: missed
        Progress(0.0, rejected=True),  # missed
        Progress(5.0),  # not arrived yet
    ]
    assert certain_misses(progress, 1.0, limits) == 3
    assert certain_misses(progress, 1.3, limits) == 4  # the waiting one is now past 1000 ms
    assert certain_misses(progress, 1.3, {}) == 1  # only the rejected one
    assert target_unreachable(6, 1, 0.9)  # 5/6 < 0.9
    assert not target_unreachable(10, 1, 0.9)
    assert not target_unreachable(6, 6, None)


def test_certain_meets_and_decided_targets():
    limits = {"ttft_ms": 1000.0, "tpot_ms": 100.0}
    progress = [
        Progress(0.0, first_token_s=0.2, finish_s=0.6, output_tokens=5),  # tpot exactly 100 ms: met, not certainly
        Progress(0.0, first_token_s=0.1, finish_s=0.4, output_tokens=5),  # met: tpot 75 ms
        Progress(0.5, first_token_s=0.6),  # still running: not counted
        Progress(1.0, rejected=True),
    ]
    assert certain_meets(progress, limits) == 1  # the first one is exactly at the limit: not certain
    assert target_certain(10, 9, 0.9) and not target_certain(10, 8, 0.9) and not target_certain(10, 9, None)
    # A request still decoding already has a TPOT of at least the time so far over its max tokens.
    slow = Progress(0.0, first_token_s=0.1, max_new_tokens=5)
    assert certain_misses([slow], 0.45, limits) == 0  # (0.45 - 0.1) / 4 = 87 ms so far
    assert certain_misses([slow], 0.55, limits) == 1  # 112 ms: it can only get worse


def test_constraints_per_objective():
    slo = parse_slo(["ttft_p99_ms=1000", "tpot_p99_ms=100", "quality_min=0.9", "output_tokens_per_s_min=5"])
    assert study_constraints(slo, capacity=True, latency=False) == ["output_tokens_per_s_min", "quality_min",
                                                                    "attainment_min"]
    assert study_constraints(slo, capacity=False, latency=False) == ["output_tokens_per_s_min", "quality_min"]
    assert study_constraints(slo, capacity=False, latency=True) == slo.constraint_names()
    assert "attainment_min" in slo.constraint_names()
    # Old spellings of metric names are read, and unknown ones are one line.
    assert parse_slo(["ttft_ms_p99=500"]).bounds == {"ttft_p99_ms": 500.0}
    with pytest.raises(SloError) as e:
        parse_slo(["ttft_p99_msec=1"])
    assert "did you mean ttft_p99_ms" in str(e.value) and "\n" not in str(e.value)


def test_objectives_directions_pareto_and_gain():
    assert parse_objectives("goodput") == ["goodput_rps"]
    assert parse_objectives("output_tokens_per_s, tpot_p99_ms") == ["output_tokens_per_s", "tpot_p99_ms"]
    for bad in ("speed", "goodput,goodput_rps", ","):
        with pytest.raises(ObjectiveError) as e:
            parse_objectives(bad)
        assert "\n" not in str(e.value)
    dirs = ["maximize", "minimize"]
    points = [[10, 50], [12, 60], [9, 55], [12, 50]]
    assert pareto_ranks(points, dirs) == [1, 1, 2, 0]
    assert gain(4.0, 2.0, "maximize") == 2.0 and gain(50.0, 100.0, "minimize") == 2.0
    assert gain(1.0, 0.0, "maximize") == math.inf and gain(None, 1.0, "maximize") is None
    metrics = trial_metrics({"ttft_p99_ms": 12.0, "output_tokens_per_s": 5.0}, {"goodput_rps": 1.5})
    assert trial_metrics({"ttft_ms_p99": 12.0})["ttft_p99_ms"] == 12.0  # summaries stored before the table
    assert metrics["ttft_p99_ms"] == 12.0 and metrics["goodput_rps"] == 1.5
    assert objective_values(metrics, ["goodput_rps", "ttft_p99_ms"]) == [1.5, 12.0]
    assert "not measured" in objective_values(metrics, ["tpot_p99_ms"])


@pytest.mark.parametrize("text, seconds", [("8h", 28800), ("90m", 5400), ("1h30m", 5400), ("45s", 45),
                                           ("3600", 3600), ("2d", 172800), ("1.5h", 5400), ("500ms", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "8x", "h", "0", "-5m", "1h 3x"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)
