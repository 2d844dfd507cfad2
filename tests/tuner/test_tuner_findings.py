"""The tuner's answer is a finding: a knob that acts is ranked first and its gain confirmed beyond the noise;
when nothing acts, it says so. Real studies on the tiny model (offline replays: a second or less each)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from sqlalchemy import select

from db.models import MeasurementRow, Study
from db.session import session_scope
from engine.config import Search, knobs
from engine.hwinfo import hardware
from tuner.baselines import Baseline, BaselineContext, baseline_points
from tuner.export import find_study, study_report
from tuner.findings import confirmation
from tuner.importance import param_importance, verdict
from tuner.repeats import NoisePhase, confirm
from tuner.report import print_report
from tuner.space import build_space
from tuner.stats import MIN_EFFECT, NO_GAIN
from tuner.study import enqueue_baselines, run_trials
from workloads.synth import synth_workload

BATCH = "scheduler.max_batch_seqs"
#: Greedy decoding never reads top-p: a knob that cannot act.
NEUTRAL = "sampling.top_p"


@pytest.fixture(scope="module")
def decode_heavy():
    """32 requests of 16 output tokens, all at once: throughput grows with the sequences batched together,
    up to the 32 the search may batch."""
    return synth_workload("decode-heavy", 32, arrival="offline", prompt_len="uniform:8:16", output_len="16",
                          seed=11)


def _space(keys):
    ranges = {NEUTRAL: Search(low=0.5, high=1.0), BATCH: Search(low=1, high=32, log=True)}
    registry = [dataclasses.replace(k, search=ranges[k.key]) for k in knobs() if k.key in keys]
    return build_space(hardware(), registry=registry)


def _study(wire, sqlite_url, workload, keys, baselines, trials, name):
    w = wire(sqlite_url, slo=["quality_min=0.5"], space=_space(keys), mode="offline", max_requests=None,
             objectives=["output_tokens_per_s"], workload=workload, name=name)
    points = baseline_points(w.objective.space, BaselineContext(base=w.objective.base), baselines)
    assert [b.name for b, _ in points] == [b.name for b in baselines]
    enqueue_baselines(w.study, points)
    noise = NoisePhase(w.objective.measurer, w.objective.recorder, 3)
    w.objective.margin = noise.margin
    run_trials(w.study, w.objective, trials, between=noise)
    return w


def _report(w):
    with session_scope(w.db) as s:
        return study_report(s, find_study(s, w.name))


def test_a_knob_that_acts_ranks_first_and_its_gain_is_confirmed(sqlite_url, wire, decode_heavy, capsys):
    one = Baseline("one-at-a-time", "one sequence per step", {BATCH: 1})
    w = _study(wire, sqlite_url, decode_heavy, {BATCH, NEUTRAL}, [Baseline("defaults", "", {}), one], 14, "acts")
    imp = param_importance(w.study)
    assert max(imp["importances"], key=imp["importances"].get) == BATCH
    session = confirm(w.objective.measurer, w.db, w.study_id, top=1, repeats=3)
    report = _report(w)
    conf = report["confirmation"]
    assert session == conf["session"] == 1 and conf["repeats"] == 3
    gains = {g["baseline"]: g for g in conf["gains"]}
    assert gains["one-at-a-time"]["verdict"] == "gain" and gains["one-at-a-time"]["gain"]["lo"] > 2
    assert report["within_noise"] is False
    ranked = verdict(imp, report["within_noise"], report["noise"])
    assert ranked["ranked"] and next(iter(ranked["importances"])) == BATCH
    print_report({**report, "importance": ranked})
    out = capsys.readouterr().out
    assert "over one-at-a-time" in out and f"parameter importance: {BATCH}" in out


def test_when_nothing_acts_the_finding_says_no_gain_beyond_noise(sqlite_url, wire, decode_heavy, capsys):
    w = _study(wire, sqlite_url, decode_heavy, {NEUTRAL}, [Baseline("defaults", "", {})], 6, "inert")
    confirm(w.objective.measurer, w.db, w.study_id, top=1, repeats=5)
    report = _report(w)
    conf = report["confirmation"]
    (g,) = conf["gains"]
    assert g["baseline"] == "defaults" and g["verdict"] == NO_GAIN and g["gain"]["method"].startswith("bootstrap")
    # The interval holds 1, or the medians are within MIN_EFFECT: offsets that outlast a run (stats.py).
    assert g["gain"]["lo"] <= 1 <= g["gain"]["hi"] or abs(math.log(g["gain"]["median"])) < math.log1p(MIN_EFFECT)
    print_report(report)
    out = capsys.readouterr().out
    assert "finding: no config beats the defaults beyond noise on this machine" in out


def test_confirm_interleaves_records_the_order_and_its_intervals_hold_the_medians(sqlite_url, wire, decode_heavy):
    one = Baseline("one-at-a-time", "one sequence per step", {BATCH: 1})
    w = _study(wire, sqlite_url, decode_heavy, {BATCH}, [Baseline("defaults", "", {}), one], 5, "order")
    first = confirm(w.objective.measurer, w.db, w.study_id, top=2, repeats=3)
    second = confirm(w.objective.measurer, w.db, w.study_id, top=1, repeats=2)
    assert (first, second) == (1, 2)
    with session_scope(w.db) as s:
        study = s.scalars(select(Study).where(Study.id == w.study_id)).one()
        rows = s.scalars(select(MeasurementRow).where(MeasurementRow.purpose == "confirm", MeasurementRow.session == 1)
                         .order_by(MeasurementRow.seq)).all()
        order = [(r.repeat, r.trial.number) for r in rows]
        older = confirmation(s, study, session_no=1)
        latest = confirmation(s, study)
    picked = [n for r, n in order if r == 0]
    assert len(picked) == len(set(picked)) >= 3  # two searched configs (or fewer distinct) and both baselines
    assert order == [(r, n) for r in range(3) for n in (picked if r % 2 == 0 else picked[::-1])]  # A B C C B A A B C
    assert older["order"] == [n for _, n in order] and latest["session"] == 2 and latest["repeats"] == 2
    for summary in (older, latest):
        for c in summary["configs"]:
            iv = c["interval"]
            assert iv["lo"] <= iv["median"] <= iv["hi"] and iv["n"] == summary["repeats"]
        for g in summary["gains"]:
            assert g["gain"]["lo"] <= g["gain"]["median"] <= g["gain"]["hi"]



def test_a_best_config_at_the_highest_rate_tried_makes_its_gains_lower_bounds(sqlite_url, wire, decode_heavy):
    """Found on an idle machine: the best config met the target with the whole workload inside the search's
    ceiling in 2 of 3 confirmation runs, and the summary printed its x7.01 over the defaults as a plain
    figure. Runs that met the target at the highest rate tried are lower bounds: the gain says "at least"."""
    one = Baseline("one-at-a-time", "one sequence per step", {BATCH: 1})
    w = _study(wire, sqlite_url, decode_heavy, {BATCH}, [Baseline("defaults", "", {}), one], 5, "ceiling")
    confirm(w.objective.measurer, w.db, w.study_id, top=1, repeats=3)
    with session_scope(w.db) as s:
        study = s.scalars(select(Study).where(Study.id == w.study_id)).one()
        plain = confirmation(s, study)
        best = plain["best"]["trial_id"]
        rows = s.scalars(select(MeasurementRow).where(MeasurementRow.purpose == "confirm")).all()
        for r in rows:
            r.bounded = r.trial_id != best if r.repeat < 2 else True  # the best open above in 2 of 3 runs
        s.flush()
        censored = confirmation(s, study)
    before = {g["baseline"]: g for g in plain["gains"]}
    after = {g["baseline"]: g for g in censored["gains"]}
    assert before["one-at-a-time"]["verdict"] == "gain" and not before["one-at-a-time"]["text"].startswith("at least")
    gain = after["one-at-a-time"]
    assert gain["verdict"] == "gain" and gain["text"].startswith("at least x")
    assert "2 of the best config's 3 runs met the target at the highest rate tried" in gain["text"]
    if after["defaults"]["verdict"] != "gain":  # a lower bound across 1 is no verdict, never a loss
        assert after["defaults"]["verdict"] == NO_GAIN and after["defaults"]["text"].startswith("at least x")


def test_censored_gain_rows_over_a_baseline_also_open_above():
    from tuner.findings import _censored

    best = {"values": [188.0, 74.4, 188.0], "open_above": 2}
    other = {"baseline": "defaults", "values": [30.0, 27.0, 188.0], "open_above": 1}
    both = _censored({"text": "x6.96 over defaults", "verdict": "gain"}, best, other)
    assert both["verdict"] == NO_GAIN and both["text"].startswith("over defaults: not comparable")
    upper = _censored({"text": "x0.50 over defaults (0.4-0.6, 3 runs each)", "verdict": "loss"},
                      {"values": [10.0, 11.0, 12.0], "open_above": 0}, other)
    assert upper["text"].startswith("at most x0.50 over defaults")


def test_a_trial_diff_lists_only_knobs_that_act():
    from engine.config import EngineConfig
    from tuner.export import acting_changes
    from tuner.space import flatten

    defaults = flatten(EngineConfig().to_dict())
    inert = flatten(EngineConfig().replace(int4_group_size=64, max_batch_seqs=8).to_dict())
    assert acting_changes(inert, defaults) == {"scheduler.max_batch_seqs": 8}  # no int4 experts: the group is inert
    int4 = flatten(EngineConfig().replace(int4_group_size=64, hi_precision="int4").to_dict())
    assert acting_changes(int4, defaults) == {"experts.hi_precision": "int4", "experts.int4_group_size": 64}


def test_a_baseline_that_met_the_target_at_no_rate_bounds_the_gain_from_below():
    from tuner.findings import gain_over_zero

    row = gain_over_zero("hf-static-like", 3, 33.5, 1.42)
    assert row["verdict"] == "gain" and row["lower_bound"] == pytest.approx(33.5 / 1.42)
    assert row["text"].startswith("more than x23.6 over hf-static-like") and "down to 1.42 req/s" in row["text"]
    assert "3 runs" in row["text"]
    unbounded = gain_over_zero("hf-static-like", 2, 33.5, None)  # no probe rate recorded: no bound claimed
    assert unbounded["lower_bound"] is None and unbounded["text"].startswith("over hf-static-like")


def test_a_baseline_at_zero_in_some_runs_bounds_the_gain_by_its_best_run():
    """Found in a 30-minute chat run: llama.cpp-like met the target at no rate in 2 of 3 confirmation runs
    and up to 0.633 req/s in the third; the summary said "not measured". The bound takes the highest
    capacity the baseline could have had in any run."""
    from tuner.findings import gain_over_zero
    from tuner.stats import NO_GAIN

    row = gain_over_zero("llama.cpp-like", 3, 2.774, 0.297, [0.633])
    assert row["verdict"] == "gain" and row["lower_bound"] == pytest.approx(2.774 / 0.633)
    assert row["text"].startswith("more than x4.38 over llama.cpp-like") and "in 2 of 3 runs" in row["text"]
    assert "up to 0.633 req/s in the other;" in row["text"]
    close = gain_over_zero("llama.cpp-like", 3, 2.774, 0.297, [2.5, 3.1])  # its best run beats the best's lowest
    assert close["verdict"] == NO_GAIN and close["lower_bound"] < 1 and "in 1 of 3 runs" in close["text"]
    assert "in the others" in close["text"]
