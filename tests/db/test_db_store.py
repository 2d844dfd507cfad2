"""Storing runs: what the tuner writes is what the dashboard reads back, on both backends."""

from __future__ import annotations

import math
import time

import pytest
from sqlalchemy import delete, func, insert, select
from sqlalchemy.exc import IntegrityError

from db.models import (
    ExpertStatRow,
    MeasurementRow,
    Model,
    ProbeRow,
    RequestRow,
    StepRow,
    Study,
    TelemetryRow,
    Trial,
)
from db.session import DatabaseError, session_scope
from db.store import (
    SUMMARY_COLUMNS,
    add_measurement,
    create_study,
    fail_trial,
    finish_trial,
    get_or_create_model,
    get_or_create_workload,
    get_study,
    next_session,
    start_trial,
    trial_result_dict,
)

CHILDREN = (RequestRow, StepRow, ExpertStatRow, TelemetryRow)
IDENTITY = {
    "path": "/models/tiny",
    "arch": "tiny-moe",
    "fingerprint": "fp-tiny",
    "n_params": 12_345_678,
    "shapes": {"layers": 2, "experts": 4, "hidden": 64},
    "dtype": "bfloat16",
}
CONFIG = {"runtime": {"expert_budget_gib": 1.5}, "scheduler": {"max_batch_seqs": 8}}


def _study(s, name: str = "study-a", space: str = "space1") -> int:
    model_id = get_or_create_model(s, IDENTITY)
    workload_id = get_or_create_workload(
        s, "builtin-chat", source="builtin", n_requests=6, duration_s=0.3, metadata={"seed": 0}
    )
    return create_study(
        s,
        name,
        model_id=model_id,
        workload_id=workload_id,
        backend="sim",
        search_space_hash=space,
        objectives=["goodput"],
        slo={"ttft_p99_ms": 2000, "tpot_p99_ms": 200},
        hardware={"cpu": "test", "gpus": []},
        software={"torch": "none"},
        optuna_study_name=f"{name}-{space}",
    )


def _count(s, row_model, trial_id=None) -> int:
    q = select(func.count()).select_from(row_model)
    if trial_id is not None:
        q = q.where(row_model.trial_id == trial_id)
    return s.scalar(q)


def test_store_a_run_result_and_read_it_back(engine, run_result_factory):
    result = run_result_factory()
    stored = result.to_dict()
    met = {r.request_id: r.finish_reason != "rejected" and (r.ttft_ms or 0) < 25 for r in result.requests}
    with session_scope(engine) as s:
        study_id = _study(s)
        trial_id = start_trial(s, study_id, 0, CONFIG, "cfg0", is_baseline=True, baseline_name="defaults")
        assert s.get(Trial, trial_id).state == "running"
        finish_trial(
            s, trial_id, stored, "complete", slo_attainment=0.8, goodput_rps=3.2, met_slo_per_request=met
        )

    with session_scope(engine) as s:
        trial = s.get(Trial, trial_id)
        summary = result.summary()
        assert trial.state == "complete" and trial.finished_at is not None and trial.error is None
        assert trial.is_baseline and trial.baseline_name == "defaults"
        assert trial.config == CONFIG and trial.config_hash == "cfg0" and trial.number == 0
        assert trial.summary == stored["summary"] and trial.meta == stored["meta"]
        assert (trial.slo_attainment, trial.goodput_rps) == (0.8, 3.2)
        for column in SUMMARY_COLUMNS:
            if column not in ("slo_attainment", "goodput_rps"):  # given as arguments
                assert getattr(trial, column) == summary.get(column), column
        assert trial.ttft_p99_ms == summary["ttft_p99_ms"] and trial.quality_top1_agreement == 0.97
        assert trial.peak_device_mem_bytes is None

        back = trial_result_dict(s, trial_id)
        assert [r.pop("met_slo") for r in back["requests"]] == [
            met[r["request_id"]] for r in stored["requests"]
        ]
        assert back == stored

        study = s.get(Study, study_id)
        assert study.model.identity == IDENTITY and study.model.n_params == IDENTITY["n_params"]
        assert study.workload.meta == {"seed": 0} and study.workload.n_requests == 6
        assert [t.id for t in study.trials] == [trial_id]
        assert study.objectives == ["goodput"] and study.slo["ttft_p99_ms"] == 2000
        assert len(study.hardware_hash) == 16


def test_get_or_create_returns_the_same_rows(engine):
    with session_scope(engine) as s:
        study_id = _study(s)
        model_id = get_or_create_model(s, IDENTITY)
    with session_scope(engine) as s:
        assert _study(s) == study_id  # re-running the same command resumes the study
        assert get_or_create_model(s, dict(IDENTITY)) == model_id
        assert s.scalar(select(func.count()).select_from(Model)) == 1
        other = get_or_create_model(s, {"path": "/models/other", "arch": "x"})  # fingerprint computed
        assert other != model_id and get_or_create_model(s, {"path": "/models/other", "arch": "x"}) == other
        assert get_study(s, "study-a").id == study_id and get_study(s, "nope") is None


def test_same_study_name_with_another_search_space_is_refused(engine):
    with session_scope(engine) as s:
        _study(s)
    with session_scope(engine) as s, pytest.raises(DatabaseError, match="search_space_hash"):
        _study(s, space="space2")


def test_fail_trial_records_the_error(engine):
    with session_scope(engine) as s:
        study_id = _study(s)
        t1 = start_trial(s, study_id, 1, CONFIG, "cfg1")
        t2 = start_trial(s, study_id, 2, CONFIG, "cfg2")
        fail_trial(s, t1, "CUDA out of memory: tried to allocate 2.0 GiB")
        fail_trial(s, t2, "expert budget 99 GiB exceeds the device", state="infeasible")
        with pytest.raises(ValueError, match="state"):
            fail_trial(s, t1, "x", state="complete")
        with pytest.raises(ValueError, match="no trial"):
            fail_trial(s, 10_000, "x")
    with session_scope(engine) as s:
        states = dict(s.execute(select(Trial.number, Trial.state)).all())
        assert states == {1: "failed", 2: "infeasible"}
        assert s.get(Trial, t1).error.startswith("CUDA out of memory")
        failed = s.scalars(select(Trial).where(Trial.study_id == study_id, Trial.state == "failed")).all()
        assert [t.id for t in failed] == [t1]


def test_restarting_a_trial_replaces_its_records(engine, run_result_factory):
    result = run_result_factory().to_dict()
    with session_scope(engine) as s:
        study_id = _study(s)
        trial_id = start_trial(s, study_id, 5, CONFIG, "cfg")
        finish_trial(s, trial_id, result, "complete")
        assert start_trial(s, study_id, 5, CONFIG, "cfg") == trial_id
        assert _count(s, RequestRow, trial_id) == 0
        trial = s.get(Trial, trial_id)
        assert trial.state == "running" and trial.summary is None and trial.ttft_p99_ms is None
        finish_trial(s, trial_id, result, "pruned")
        finish_trial(s, trial_id, result, "complete")  # finishing twice does not duplicate rows
        assert _count(s, RequestRow, trial_id) == len(result["requests"])
        assert _count(s, StepRow, trial_id) == len(result["steps"])


def test_non_finite_numbers_are_stored_as_null(engine, run_result_factory):
    result = run_result_factory().to_dict()
    result["summary"]["ttft_p99_ms"] = math.inf
    result["summary"]["quality_mean_kl"] = math.nan
    result["requests"][0]["itl_ms"] = [1.0, math.nan]
    with session_scope(engine) as s:
        trial_id = start_trial(s, _study(s), 0, CONFIG, "cfg")
        finish_trial(s, trial_id, result, "complete")
    with session_scope(engine) as s:
        trial = s.get(Trial, trial_id)
        assert trial.ttft_p99_ms is None and trial.quality_mean_kl is None
        assert trial.summary["ttft_p99_ms"] is None
        assert trial_result_dict(s, trial_id)["requests"][0]["itl_ms"] == [1.0, None]


def test_foreign_keys_are_enforced(engine):
    with pytest.raises(IntegrityError), session_scope(engine) as s:
        s.execute(insert(Trial), [{"study_id": 12345, "config": {}, "config_hash": "x", "state": "running"}])
    with pytest.raises(IntegrityError), session_scope(engine) as s:
        s.execute(
            insert(StepRow),
            [
                {
                    "trial_id": 999,
                    "step": 0,
                    "start_s": 0.0,
                    "duration_ms": 1.0,
                    "batch_seqs": 1,
                    "prefill_tokens": 1,
                    "decode_tokens": 0,
                }
            ],
        )


def test_check_constraints_reject_unknown_states(engine):
    with session_scope(engine) as s:
        study_id = _study(s)
    with pytest.raises(IntegrityError), session_scope(engine) as s:
        s.execute(insert(Trial), [{"study_id": study_id, "config": {}, "config_hash": "x", "state": "weird"}])


def test_deleting_a_trial_or_study_cascades(engine, run_result_factory):
    result = run_result_factory().to_dict()
    with session_scope(engine) as s:
        study_id = _study(s)
        ids = [start_trial(s, study_id, n, CONFIG, f"cfg{n}") for n in range(3)]
        for trial_id in ids:
            finish_trial(s, trial_id, result, "complete")
    with session_scope(engine) as s:
        assert all(_count(s, m) > 0 for m in CHILDREN)
        s.delete(s.get(Trial, ids[0]))  # through the ORM: the database does the cascade
    with session_scope(engine) as s:
        assert all(_count(s, m, ids[0]) == 0 for m in CHILDREN)
        assert all(_count(s, m, ids[1]) > 0 for m in CHILDREN)
        s.execute(delete(Trial).where(Trial.id == ids[1]))  # plain SQL
    with session_scope(engine) as s:
        assert all(_count(s, m, ids[1]) == 0 for m in CHILDREN)
        assert _count(s, RequestRow, ids[2]) == len(result["requests"])
        model_id = s.get(Study, study_id).model_id
    with pytest.raises(IntegrityError), session_scope(engine) as s:  # a model in use stays
        s.execute(delete(Model).where(Model.id == model_id))
    with session_scope(engine) as s:
        s.execute(delete(Study).where(Study.id == study_id))
    with session_scope(engine) as s:
        assert _count(s, Trial) == 0 and all(_count(s, m) == 0 for m in CHILDREN)


def test_thousands_of_rows_insert_fast(engine, run_result_factory):
    result = run_result_factory(n_requests=3000, n_steps=10000, layers=32, experts=64, itl_per_request=32)
    stored = result.to_dict()
    with session_scope(engine) as s:
        trial_id = start_trial(s, _study(s), 0, CONFIG, "cfg")
    t0 = time.perf_counter()
    with session_scope(engine) as s:
        finish_trial(s, trial_id, stored, "complete")
    elapsed = time.perf_counter() - t0
    with session_scope(engine) as s:
        assert _count(s, RequestRow, trial_id) == 3000
        assert _count(s, StepRow, trial_id) == 10000
        assert _count(s, ExpertStatRow, trial_id) == 32 * 64
    assert elapsed < 5, f"storing 15k rows took {elapsed:.1f} s"


def test_measurements_and_probes_of_a_trial(engine):
    probes = [{"rate_scale": 1.0, "rate_rps": 3.0, "attainment": 1.0, "met": True, "stopped": True, "n_requests": 8,
               "duration_s": 2.5, "goodput_rps": 2.9, "ttft_p99_ms": 120.0, "tpot_p99_ms": 40.0},
              {"rate_scale": 2.0, "rate_rps": 6.0, "attainment": 0.5, "met": False, "stopped": True,
               "n_requests": 8, "duration_s": 0.8, "goodput_rps": math.nan, "ttft_p99_ms": None, "tpot_p99_ms": None}]
    with session_scope(engine) as s:
        study_id = _study(s)
        trial_id = start_trial(s, study_id, 0, CONFIG, "cfg")
        assert next_session(s, study_id, "confirm") == 0
        m1 = add_measurement(s, study_id, trial_id, purpose="search", objective="capacity_rps", value=4.2,
                             fidelity=1.0, n_requests=8, runs_s=3.3, overhead_s=0.05, probes=probes, bounded=True)
        add_measurement(s, study_id, trial_id, purpose="confirm", objective="capacity_rps", value=None,
                        upper_bound=3.0, fidelity=1.0, n_requests=8, runs_s=0.8, overhead_s=0.01, session_no=1,
                        repeat=0, seq=0, stopped_early=True, note="cannot beat it")
        assert next_session(s, study_id, "confirm") == 2 and next_session(s, study_id, "noise") == 0
        with pytest.raises(ValueError, match="purpose"):
            add_measurement(s, study_id, trial_id, purpose="guess", objective="x", value=1.0, fidelity=1.0,
                            n_requests=1, runs_s=0.0, overhead_s=0.0)
    with session_scope(engine) as s:
        trial = s.get(Trial, trial_id)
        search, confirm = sorted(trial.measurements, key=lambda m: m.id)
        assert search.id == m1 and search.value == 4.2 and search.bounded and not search.stopped_early
        assert [(p.seq, p.rate_rps, p.met, p.goodput_rps) for p in search.probes] == [(0, 3.0, True, 2.9),
                                                                                    (1, 6.0, False, None)]
        assert confirm.value is None and confirm.upper_bound == 3.0 and confirm.session == 1 and confirm.probes == []
    with session_scope(engine) as s:  # a trial owns its measurements, a measurement its probes
        s.delete(s.get(Trial, trial_id))
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(MeasurementRow)) == 0
        assert s.scalar(select(func.count()).select_from(ProbeRow)) == 0


def test_one_metrics_table_feeds_columns_and_summaries(run_result_factory):
    from engine.metrics import LEGACY, METRICS, canonical, column_metrics

    columns = {c.name for c in Trial.__table__.columns}
    assert {m.name for m in column_metrics()} <= columns
    assert set(SUMMARY_COLUMNS) == {m.name for m in column_metrics()}
    summary = run_result_factory().summary()
    assert set(summary) - {"quality_top1_agreement", "quality_mean_kl"} <= set(METRICS)
    assert all(canonical(old) == new and new in summary for old, new in LEGACY.items())
    with pytest.raises(ValueError, match="unknown metric 'ttft_p99_msec'; did you mean ttft_p99_ms"):
        canonical("ttft_p99_msec")


def test_a_plan_with_an_unpriced_config_round_trips_and_cascades(engine):
    """``add_plan`` on both backends: ``all`` and ``-`` become NULL, NaN becomes NULL, an error row keeps its
    text with no figures, rows keep their order; deleting the plan deletes its configs."""
    from db.models import PlanConfig, PlanRun
    from db.store import add_plan

    rows = [
        {"profile": "big", "calibrated": True, "budget_gib": "all", "hi": "auto", "missing": "-",
         "batching": "coalesced", "replicas": 0, "knobs": {}, "offline_tokens_per_s": 10.5,
         "ttft_p99_ms": 20.25, "tpot_p99_ms": float("nan"), "capacity_rps": 3.0, "capacity_bounded": True},
        {"profile": "big", "calibrated": True, "budget_gib": 4.5, "hi": "int4", "missing": "fetch",
         "batching": "micro", "replicas": 1, "knobs": {"resident_budget_gib": 4.5, "hi_precision": "int4"},
         "error": "resident_budget_gib=4.5: exceeds the device"},
    ]
    with session_scope(engine) as s:
        plan_id = add_plan(s, model="shape:m", workload="w", workload_source=None, n_requests=3,
                           slo={"ttft_p99_ms": 1000.0, "attainment_min": 0.9},
                           profiles=[{"name": "big", "calibrated": True}], base_config={"scheduler": {}},
                           software={"python": "3"}, wall_s=1.5, rows=rows)
    with session_scope(engine) as s:
        plan = s.get(PlanRun, plan_id)
        first, second = plan.configs
        assert (first.seq, first.budget_gib, first.missing_expert, first.tpot_p99_ms, first.capacity_bounded) == (
            0, None, None, None, True)
        assert (first.offline_tokens_per_s, first.ttft_p99_ms, first.capacity_rps) == (10.5, 20.25, 3.0)
        assert (second.budget_gib, second.hi_precision, second.missing_expert, second.expert_batching,
                second.max_replicas, second.knobs) == (4.5, "int4", "fetch", "micro", 1, rows[1]["knobs"])
        assert second.error == rows[1]["error"] and second.capacity_rps is None and second.capacity_bounded is None
        assert plan.profiles == [{"name": "big", "calibrated": True}] and plan.wall_s == 1.5
        s.execute(delete(PlanRun).where(PlanRun.id == plan_id))
    with session_scope(engine) as s:
        assert s.scalar(select(func.count()).select_from(PlanConfig)) == 0
