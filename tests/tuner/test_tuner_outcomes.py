"""Every way a trial can end is recorded, in our tables and Optuna's, and the study goes on."""

from __future__ import annotations

import json

import optuna
import pytest
from optuna.trial import TrialState
from sqlalchemy import select

from db.models import Trial
from db.session import make_engine, session_scope
from engine.config import EngineConfig
from tuner import measure as measure_module
from tuner.cli import main
from tuner.objective import ATTR_INTERRUPTED, ATTR_RETRY_OF, ATTR_STATE
from tuner.study import counted_trials, run_trials


def _rows(db):
    with session_scope(db) as s:
        return [(t.number, t.state, t.error) for t in s.scalars(select(Trial).order_by(Trial.number))]


def test_infeasible_failed_and_interrupted_trials_are_recorded_and_the_study_goes_on(
        sqlite_url, wire, monkeypatch):
    w = wire(sqlite_url, slo=["ttft_p99_ms=60000"])
    study, obj = w.study, w.objective
    point = w.objective.space.defaults(EngineConfig())
    n = 0

    def run_one(params):
        nonlocal n
        study.enqueue_trial(params)
        n += 1
        run_trials(study, obj, n)

    run_one(point)  # 0: complete
    obj.memory_limit_bytes = 1
    run_one({**point, "scheduler.max_batch_seqs": 8})  # 1: cannot fit: infeasible, never run
    obj.memory_limit_bytes = None
    with pytest.warns(UserWarning):  # Optuna: the enqueued value lies outside the searched range
        run_one({**point, "scheduler.max_batch_seqs": 32, "scheduler.max_batch_tokens": 16})  # 2: rejected

    engine = obj.engine

    def out_of_memory(config):
        raise MemoryError("cannot allocate 64 GiB")

    monkeypatch.setattr(engine, "reconfigure", out_of_memory)
    run_one({**point, "scheduler.max_batch_seqs": 4})  # 3: crashes: failed, and the study goes on
    run_one({**point, "scheduler.max_batch_seqs": 5})  # 4: a fresh engine (the old one is suspect)
    assert obj.engine is not engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(measure_module, "run_workload", interrupted)
    study.enqueue_trial({**point, "scheduler.max_batch_seqs": 6})
    with pytest.raises(KeyboardInterrupt):
        run_trials(study, obj, 6)  # 5: Ctrl-C: recorded, re-enqueued, and the interrupt goes on up
    monkeypatch.undo()
    run_trials(study, obj, 6)  # 6: the interrupted trial's retry

    rows = _rows(w.db)
    assert [(num, state) for num, state, _ in rows] == [
        (0, "complete"), (1, "infeasible"), (2, "infeasible"), (3, "failed"), (4, "complete"), (5, "failed"),
        (6, "complete")]
    errors = {num: err for num, _, err in rows}
    assert "GiB" in errors[1] and "available" in errors[1]
    assert "scheduler.max_batch_seqs=32" in errors[2] and "max_batch_tokens=16" in errors[2]
    assert errors[3].startswith("out of memory: MemoryError: cannot allocate 64 GiB")
    assert "interrupted" in errors[5]
    assert all("\n" not in (e or "") for e in errors.values())

    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.PRUNED,
                                         TrialState.FAIL, TrialState.COMPLETE, TrialState.FAIL,
                                         TrialState.COMPLETE]
    assert [t.user_attrs.get(ATTR_STATE) for t in trials[1:4]] == ["infeasible", "infeasible", "failed"]
    assert trials[5].user_attrs[ATTR_INTERRUPTED] and trials[6].user_attrs[ATTR_RETRY_OF] == 5
    assert trials[6].params == trials[5].params
    assert [t.number for t in counted_trials(trials)] == [0, 1, 2, 3, 4, 6]
    if hasattr(trials[1], "constraints"):  # Optuna >= 5: infeasible trials violate every constraint
        assert trials[1].constraints and all(v > 0 for v in trials[1].constraints.values())


def test_a_trial_that_cannot_meet_the_slo_is_cut_short(sqlite_url, wire):
    w = wire(sqlite_url, slo=["ttft_p99_ms=1"], mode="realtime", name="tight")
    point = w.objective.space.defaults(EngineConfig())
    w.study.enqueue_trial(point)
    run_trials(w.study, w.objective, 1)
    (num, state, error), = _rows(w.db)
    assert state == "pruned" and error.startswith("whole workload: stopped after ") and "missed the SLO" in error
    assert w.study.trials[0].state == TrialState.PRUNED
    # Baselines are never cut short: the gain over them needs their numbers.
    w.study.enqueue_trial(point, user_attrs={"baseline": "defaults"})
    run_trials(w.study, w.objective, 2)
    assert _rows(w.db)[1][1] == "complete"
    with session_scope(w.db) as s:
        baseline = s.scalars(select(Trial).where(Trial.number == 1)).one()
        assert baseline.slo_attainment == 0 and baseline.summary["feasible"] is False


def test_a_trial_pruned_on_the_first_rung_skips_the_quality_check(sqlite_url, wire):
    """Quality is read only for trials that pass the first rung: a searched trial cut there records
    "pruned first" and spends no time on it; a baseline checks it first, and the same config searched
    and promoted past the first rung has it too."""
    w = wire(sqlite_url, slo=["ttft_p99_ms=1"], mode="realtime", name="deferred", rungs=(0.5, 1.0),
             max_requests=12)
    point = w.objective.space.defaults(EngineConfig())
    w.study.enqueue_trial(point, user_attrs={"baseline": "defaults"})
    w.study.enqueue_trial(point)
    run_trials(w.study, w.objective, 2)
    with session_scope(w.db) as s:
        baseline, searched = s.scalars(select(Trial).order_by(Trial.number)).all()
        assert baseline.state == "complete" and baseline.summary["quality_check"] in ("measured", "cached")
        assert baseline.quality_top1_agreement is not None
        assert searched.state == "pruned" and searched.error.startswith("50% of the workload")
        assert searched.summary["quality_check"] == "pruned first" and searched.summary["quality_s"] == 0
        assert searched.quality_top1_agreement is None


def test_a_config_under_the_quality_floor_never_sets_the_bar(sqlite_url, wire):
    """A searched trial checks its (deferred) quality right after its first-rung search, before the value
    counts: a config under the floor ends infeasible without becoming the rung's incumbent or a competitor
    of the pruner, however fast it ran."""
    from tuner.objective import ATTR_RUNGS, incumbent_value

    w = wire(sqlite_url, slo=["quality_min=0.999"], mode="offline", name="floor", rungs=(0.5, 1.0),
             max_requests=12, objectives=["output_tokens_per_s"])
    point = w.objective.space.defaults(EngineConfig())
    w.study.enqueue_trial(point, user_attrs={"baseline": "defaults"})
    w.study.enqueue_trial({**point, "runtime.compute_dtype": "checkpoint"})  # bf16 products: agreement < 1
    run_trials(w.study, w.objective, 2)
    (_, base_state, _), (_, state, error) = _rows(w.db)
    assert base_state == "complete" and state == "infeasible" and "misses quality_min=0.999" in error, error
    base, low = w.study.trials
    assert ATTR_RUNGS not in low.user_attrs and not low.intermediate_values
    assert incumbent_value(w.study, 0) == base.user_attrs[ATTR_RUNGS]["0"]


def test_the_first_searched_trial_competes_with_the_baselines_at_the_first_rung(sqlite_url, wire):
    """Successive halving measures a searched trial against every value at its rung, the baselines' too: a
    first searched trial far below the defaults is cut on the prefix, not promoted for want of competitors."""
    from workloads.synth import synth_workload

    wl = synth_workload("batchy", 24, arrival="offline", prompt_len="uniform:8:16", output_len="16", seed=5)
    w = wire(sqlite_url, mode="offline", name="competes", rungs=(0.5, 1.0), max_requests=None,
             objectives=["output_tokens_per_s"], workload=wl)
    point = w.objective.space.defaults(EngineConfig())
    w.study.enqueue_trial(point, user_attrs={"baseline": "defaults"})
    w.study.enqueue_trial({**point, "scheduler.max_batch_seqs": 1})  # one sequence a step: far slower
    run_trials(w.study, w.objective, 2)
    (_, base_state, _), (_, state, error) = _rows(w.db)
    assert base_state == "complete"
    assert state == "pruned" and "not among the best at this fidelity" in error, error


def test_multi_objective_study_and_capacity(sqlite_url, tmp_path, capsys, kit, tiny_workload):
    rc = main(["run", *kit.FAST, "--trials", "3", "--db", sqlite_url, "--study", "pareto",
               "--objectives", "output_tokens_per_s,tpot_p99_ms", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    name = next(n for n in optuna.get_all_study_names(sqlite_url) if n.startswith("pareto-"))
    study = optuna.load_study(study_name=name, storage=sqlite_url)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"] and len(study.trials) == 3
    assert main(["show", "--study", "pareto", "--db", sqlite_url, "--json"]) == 0
    report = kit.last_json(capsys.readouterr().out)
    assert report["objectives"] == ["output_tokens_per_s", "tpot_p99_ms"] and report["best"]
    out = tmp_path / "pareto.json"
    assert main(["export", "--study", "pareto", "--db", sqlite_url, "--out", str(out), "--rank", "2"]) == 0
    assert json.loads(out.read_text())["metrics"]["objectives"].keys() == {"output_tokens_per_s", "tpot_p99_ms"}

    # Capacity (the default objective): every probe is stored with its rate and attainment.
    rc = main(["run", "--model", kit.MODEL, "--workload", kit.WORKLOAD, "--max-requests", "8", "--trials", "1",
               "--db", sqlite_url, "--study", "cap", "--slo", "ttft_p99_ms=400", "--noise-repeats", "0",
               "--confirm-repeats", "0", "--quiet", "--json"])
    assert rc == 0, capsys.readouterr().err
    with session_scope(make_engine(sqlite_url)) as s:
        trial = s.scalars(select(Trial).where(Trial.baseline_name == "defaults").order_by(Trial.id.desc())).first()
        summary = trial.summary
        (m,) = [m for m in trial.measurements if m.purpose == "search"]
        probes = [(p.rate_scale, p.rate_rps, p.attainment, p.met) for p in m.probes]
        value = m.value
        columns = (trial.capacity_rps, trial.fidelity, trial.measured_s, trial.overhead_s)
    first = [r.arrival_s for r in tiny_workload.requests[:8]]
    rate_per_s = 7 / (first[-1] - first[0])
    assert probes and all(rps == pytest.approx(scale * rate_per_s) for scale, rps, _, _ in probes)
    assert all(met == (a >= 0.9) for _, _, a, met in probes)
    capacity, fidelity, measured_s, overhead_s = columns
    assert summary["capacity_probes"] == len(probes) and capacity == summary["capacity_rps"] == value
    met = [rps for _, rps, _, ok in probes if ok]
    assert capacity == 0 if not met else summary["capacity_lo_rps"] == pytest.approx(max(met))
    assert fidelity == 1.0 and measured_s > 0 and overhead_s >= 0


def test_only_the_first_fidelity_has_the_early_stop_bar(sqlite_url, wire, monkeypatch):
    """A trial the pruner promoted is searched on the whole workload from the best capacity so far, with
    no early-stop probe at the best less the noise (a low rate: a long replay)."""
    # Bounds every replay meets: both trials reach the search's ceiling at both fidelities, so the copy
    # meets its bar and ties the best, and successive halving promotes it.
    w = wire(sqlite_url, slo=["ttft_p99_ms=60000", "tpot_p99_ms=10000"], mode="realtime", name="rungs",
             objectives=["capacity_rps"], rungs=(0.5, 1.0), max_requests=12)
    calls = []
    real = w.objective.measurer.measure

    def measure(fidelity=1.0, **kw):
        calls.append((fidelity, kw.get("incumbent_rps"), kw.get("start_rps")))
        return real(fidelity, **kw)

    monkeypatch.setattr(w.objective.measurer, "measure", measure)
    point = w.objective.space.defaults(EngineConfig())
    w.study.enqueue_trial(point, user_attrs={"baseline": "defaults"})
    w.study.enqueue_trial(point)  # the same config searched: competitive, so the pruner promotes it
    run_trials(w.study, w.objective, 2)
    baseline, searched = calls[:2], calls[2:]
    assert all(inc is None for _, inc, _ in baseline)  # baselines are never stopped early
    assert searched and searched[0][0] < 1.0 and searched[0][1] is not None  # the bar at the first fidelity
    (whole,) = [c for c in searched if c[0] == 1.0]  # promoted: no bar, started at the best so far
    assert whole[1] is None and whole[2] == pytest.approx(w.study.trials[0].user_attrs["rung_values"]["1"])
    assert w.study.trials[1].state == TrialState.COMPLETE
