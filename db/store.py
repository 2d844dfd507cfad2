"""Writing results: the calls the tuner makes, in the order it makes them.

    model_id = get_or_create_model(s, identity)
    workload_id = get_or_create_workload(s, name, source=..., n_requests=..., duration_s=...)
    study_id = create_study(s, name, model_id=..., workload_id=..., ...)
    trial_id = start_trial(s, study_id, number, config.to_dict(), config.config_hash())
    finish_trial(s, trial_id, result.to_dict(), "complete", slo_attainment=..., goodput_rps=...)
    # or fail_trial(s, trial_id, "out of memory: ...", state="failed")

Each function works inside the caller's transaction (``session_scope``) and flushes; none commits.
Plain Python only (no torch): the dashboard imports this package.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, cast

from sqlalchemy import Table, delete, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from db.models import (
    BACKENDS,
    PURPOSES,
    TRIAL_STATES,
    ExpertStatRow,
    MeasurementRow,
    Model,
    PlanConfig,
    PlanRun,
    ProbeRow,
    RequestRow,
    StepRow,
    Study,
    TelemetryRow,
    Trial,
    Validation,
    ValidationMetric,
    Workload,
    utcnow,
)
from db.session import DatabaseError
from engine.metrics import column_metrics
from engine.metrics import read as read_metric

log = logging.getLogger(__name__)

FINISHED_STATES = tuple(s for s in TRIAL_STATES if s != "running")

#: ``mt_trials`` metric columns, filled from the run summary under the same names (``engine.metrics``).
SUMMARY_COLUMNS: tuple[str, ...] = tuple(m.name for m in column_metrics())
#: Trial columns about how it was measured (``summary`` keys of the same names).
MEASURE_COLUMNS = ("fidelity", "measured_s", "overhead_s")

_REQUEST_KEYS = (
    "request_id",
    "tag",
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "first_token_s",
    "finish_s",
    "finish_reason",
    "itl_ms",
)
_STEP_KEYS = ("step", "start_s", "duration_ms", "batch_seqs", "prefill_tokens", "decode_tokens", "ep_bytes_dispatched",
              "ep_bytes_combined", "ep_imbalance")
_EXPERT_KEYS = ("layer", "expert", "tokens", "resident", "precision", "replicas")
_TELEMETRY_KEYS = ("t_s", "cpu_percent", "rss_bytes", "gpu_util_percent", "gpu_mem_bytes", "gpu_power_w")
_EXPERT_DEFAULTS = {"resident": True, "precision": "", "replicas": 0}


# ------------------------------------------------------------------------------------ helpers


def stable_hash(data: Any) -> str:
    """A short, order-independent hash of JSON-able data (16 hex digits, like ``config_hash``)."""
    blob = json.dumps(json_safe(data), sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _finite(x: Any) -> Any:
    """``x`` with NaN and infinities as None (not JSON; PostgreSQL's json type rejects them)."""
    kind = type(x)
    if kind is float:
        return x if math.isfinite(x) else None
    if x is None or kind is int or kind is str or kind is bool:
        return x
    if hasattr(x, "item"):  # a NumPy scalar
        return _finite(x.item())
    return x


def json_safe(obj: Any) -> Any:
    """``obj`` with tuples as lists, non-string keys as strings and NaN/inf as None."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, float):
        return _finite(obj)
    if obj is None or isinstance(obj, str | int | bool):
        return obj
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())  # a NumPy scalar or array
    return str(obj)


def _insert_ignore(session: Session, model: type, values: dict[str, Any], key: list[str]) -> None:
    """INSERT that does nothing when a row with the same ``key`` exists (safe between workers)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(postgresql.insert(model).values(**values).on_conflict_do_nothing(index_elements=key))
    else:
        session.execute(sqlite.insert(model).values(**values).on_conflict_do_nothing(index_elements=key))


def _rows(items: Iterable[Mapping[str, Any]], keys: tuple[str, ...], trial_id: int, **defaults: Any) -> list:
    rows = []
    for item in items:
        row = {k: _finite(item.get(k, defaults.get(k))) for k in keys}
        row["trial_id"] = trial_id
        rows.append(row)
    return rows


def _get_trial(session: Session, trial_id: int) -> Trial:
    trial = session.get(Trial, trial_id)
    if trial is None:
        raise ValueError(f"no trial with id {trial_id} in the results database")
    return trial


# ------------------------------------------------------------------------ models and workloads


def get_or_create_model(session: Session, identity: Mapping[str, Any]) -> int:
    """The id of the model with ``identity['fingerprint']``, inserting it the first time.

    ``identity`` keys used as columns: ``fingerprint``, ``path``, ``arch``, ``n_params``, ``shapes``;
    the whole dict is kept in ``mt_models.identity``. Without a fingerprint, one is computed from
    the dict itself.
    """
    identity = json_safe(dict(identity))
    fingerprint = str(identity.get("fingerprint") or stable_hash(identity))
    _insert_ignore(
        session,
        Model,
        {
            "fingerprint": fingerprint,
            "path": str(identity.get("path") or ""),
            "arch": identity.get("arch"),
            "n_params": identity.get("n_params"),
            "shapes": identity.get("shapes"),
            "identity": identity,
            "created_at": utcnow(),
        },
        ["fingerprint"],
    )
    return session.scalars(select(Model.id).where(Model.fingerprint == fingerprint)).one()


def get_or_create_workload(
    session: Session,
    name: str,
    *,
    source: str | None = None,
    n_requests: int | None = None,
    duration_s: float | None = None,
    metadata: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
) -> int:
    """The id of the workload with ``fingerprint``, inserting it the first time.

    Without a fingerprint, one is computed from the other arguments, so the same workload
    described the same way maps to one row.
    """
    meta = json_safe(dict(metadata)) if metadata is not None else None
    duration_s = _finite(duration_s)
    if not fingerprint:
        fingerprint = stable_hash(
            {"name": name, "source": source, "n_requests": n_requests, "duration_s": duration_s, "meta": meta}
        )
    _insert_ignore(
        session,
        Workload,
        {
            "fingerprint": fingerprint,
            "name": name,
            "source": source,
            "n_requests": n_requests,
            "duration_s": duration_s,
            "meta": meta,
            "created_at": utcnow(),
        },
        ["fingerprint"],
    )
    return session.scalars(select(Workload.id).where(Workload.fingerprint == fingerprint)).one()


# ------------------------------------------------------------------------------------ studies


def get_study(session: Session, name: str) -> Study | None:
    """The study called ``name``, or None."""
    return session.scalars(select(Study).where(Study.name == name)).one_or_none()


def create_study(
    session: Session,
    name: str,
    *,
    model_id: int,
    workload_id: int,
    backend: str,
    search_space_hash: str,
    objectives: list[str],
    slo: Mapping[str, Any],
    hardware: Mapping[str, Any],
    software: Mapping[str, Any],
    optuna_study_name: str | None = None,
    settings: Mapping[str, Any] | None = None,
) -> int:
    """The id of study ``name``, creating it the first time; re-running a study resumes it.

    Raises :class:`DatabaseError` when a study of that name exists for a different model,
    workload, backend or search space. A different machine (another worker) is logged only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    hardware = json_safe(dict(hardware))
    _insert_ignore(
        session,
        Study,
        {
            "name": name,
            "optuna_study_name": optuna_study_name or name,
            "model_id": model_id,
            "workload_id": workload_id,
            "hardware": hardware,
            "hardware_hash": stable_hash(hardware),
            "software": json_safe(dict(software)),
            "slo": json_safe(dict(slo)),
            "objectives": list(objectives),
            "backend": backend,
            "search_space_hash": search_space_hash,
            "settings": json_safe(dict(settings)) if settings is not None else None,
            "created_at": utcnow(),
        },
        ["name"],
    )
    study = get_study(session, name)
    assert study is not None
    session.refresh(study)  # the insert above bypassed the identity map
    mine = {
        "model_id": model_id,
        "workload_id": workload_id,
        "backend": backend,
        "search_space_hash": search_space_hash,
    }
    differ = [k for k, v in mine.items() if getattr(study, k) != v]
    if differ:
        theirs = ", ".join(f"{k}={getattr(study, k)!r} (now {mine[k]!r})" for k in differ)
        raise DatabaseError(f"study {name!r} already exists with {theirs}; choose another study name")
    if study.hardware_hash != stable_hash(hardware):
        log.warning("study %r was created on other hardware (%s)", name, study.hardware_hash)
    return study.id


# ------------------------------------------------------------------------------------- trials


def start_trial(
    session: Session,
    study_id: int,
    number: int | None,
    config: Mapping[str, Any],
    config_hash: str,
    is_baseline: bool = False,
    baseline_name: str | None = None,
) -> int:
    """Record a running trial (Optuna trial ``number`` of the study); returns its id.

    Starting the same trial number again resets it to running and clears its old records.
    """
    trial = None
    if number is not None:
        trial = session.scalars(
            select(Trial).where(Trial.study_id == study_id, Trial.number == number)
        ).one_or_none()
    if trial is None:
        trial = Trial(study_id=study_id, number=number)
        session.add(trial)
    else:
        log.info("trial %s of study %s restarted", number, study_id)
        _clear_records(session, trial.id)
        for column in (
            *SUMMARY_COLUMNS,
            *MEASURE_COLUMNS,
            "summary",
            "meta",
            "error",
            "finished_at",
        ):
            setattr(trial, column, None)
    trial.config = json_safe(dict(config))
    trial.config_hash = config_hash
    trial.state = "running"
    trial.is_baseline = is_baseline
    trial.baseline_name = baseline_name
    trial.started_at = utcnow()
    session.flush()
    return trial.id


def _clear_records(session: Session, trial_id: int) -> None:
    for row_model in (RequestRow, StepRow, ExpertStatRow, TelemetryRow):
        session.execute(
            delete(row_model).where(row_model.trial_id == trial_id),
            execution_options={"synchronize_session": False},
        )


def finish_trial(
    session: Session,
    trial_id: int,
    result_dict: Mapping[str, Any],
    state: str = "complete",
    slo_attainment: float | None = None,
    goodput_rps: float | None = None,
    met_slo_per_request: Mapping[str, bool] | None = None,
) -> None:
    """Store a run's results (``RunResult.to_dict()``) on a trial and mark it finished.

    Summary metrics land in columns and whole in ``summary``; requests, steps, expert statistics
    and telemetry are bulk-inserted (records from an earlier finish of the same trial are
    replaced). ``met_slo_per_request`` maps request ids to whether they met every SLO.
    """
    if state not in FINISHED_STATES:
        raise ValueError(f"state={state!r}: expected one of {', '.join(FINISHED_STATES)}")
    trial = _get_trial(session, trial_id)
    summary = json_safe(dict(result_dict.get("summary") or {}))
    for column in (*SUMMARY_COLUMNS, *MEASURE_COLUMNS):
        setattr(trial, column, read_metric(summary, column))
    if slo_attainment is not None:
        trial.slo_attainment = _finite(slo_attainment)
    if goodput_rps is not None:
        trial.goodput_rps = _finite(goodput_rps)
    trial.summary = summary
    trial.meta = json_safe(dict(result_dict.get("meta") or {}))
    trial.state = state
    trial.finished_at = utcnow()
    session.flush()
    _clear_records(session, trial_id)

    met = met_slo_per_request or {}
    requests = _rows(result_dict.get("requests") or (), _REQUEST_KEYS, trial_id)
    for row in requests:
        row["request_id"] = str(row["request_id"])
        row["finish_reason"] = row["finish_reason"] or ""
        row["met_slo"] = met.get(row["request_id"])
        itl = row["itl_ms"]
        if itl is not None:
            itl = [float(x) for x in itl]
            row["itl_ms"] = itl if all(map(math.isfinite, itl)) else [_finite(x) for x in itl]
    batches = (
        (RequestRow, requests),
        (StepRow, _rows(result_dict.get("steps") or (), _STEP_KEYS, trial_id)),
        (
            ExpertStatRow,
            _rows(result_dict.get("expert_stats") or (), _EXPERT_KEYS, trial_id, **_EXPERT_DEFAULTS),
        ),
        (TelemetryRow, _rows(result_dict.get("telemetry") or (), _TELEMETRY_KEYS, trial_id)),
    )
    for row_model, rows in batches:
        if rows:
            # executemany on the table: one statement for thousands of rows, no ORM objects.
            session.execute(insert(cast(Table, row_model.__table__)), rows)
    log.debug("trial %s finished (%s): %d requests", trial_id, state, len(requests))


def fail_trial(session: Session, trial_id: int, error: str, state: str = "failed",
               summary: Mapping[str, Any] | None = None) -> None:
    """Mark a trial failed (or ``infeasible``/``pruned``) with its error text and, when given, the
    ``summary`` of what it measured before it stopped (its ``fidelity``, ``measured_s``, ... columns too)."""
    if state not in FINISHED_STATES or state == "complete":
        raise ValueError(f"state={state!r}: expected failed, infeasible or pruned")
    trial = _get_trial(session, trial_id)
    trial.state = state
    trial.error = error
    if summary is not None:
        trial.summary = json_safe(dict(summary))
        for column in MEASURE_COLUMNS:
            setattr(trial, column, _finite(summary.get(column)))
    trial.finished_at = utcnow()
    session.flush()


# ------------------------------------------------------------------------------- measurements

_PROBE_KEYS = ("rate_scale", "rate_rps", "attainment", "met", "stopped", "n_requests", "duration_s", "goodput_rps",
               "ttft_p99_ms", "tpot_p99_ms")


def add_measurement(
    session: Session,
    study_id: int,
    trial_id: int,
    *,
    purpose: str,
    objective: str,
    value: float | None,
    fidelity: float,
    n_requests: int,
    runs_s: float,
    overhead_s: float,
    probes: Iterable[Mapping[str, Any]] = (),
    session_no: int = 0,
    repeat: int = 0,
    seq: int = 0,
    upper_bound: float | None = None,
    bounded: bool | None = None,
    stopped_early: bool = False,
    note: str | None = None,
) -> int:
    """Record one measurement of a trial's config and its replays (``probes``, in run order); returns its id."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose={purpose!r}: expected one of {', '.join(PURPOSES)}")
    row = MeasurementRow(study_id=study_id, trial_id=trial_id, purpose=purpose, session=session_no, repeat=repeat,
                         seq=seq, objective=objective, value=_finite(value), upper_bound=_finite(upper_bound),
                         fidelity=float(fidelity), n_requests=int(n_requests), bounded=bounded,
                         stopped_early=bool(stopped_early), note=note, runs_s=float(runs_s),
                         overhead_s=float(overhead_s), started_at=utcnow())
    session.add(row)
    session.flush()
    rows = []
    for i, p in enumerate(probes):
        r = {k: _finite(p.get(k)) for k in _PROBE_KEYS}
        r.update(measurement_id=row.id, seq=i, met=bool(r["met"]), stopped=bool(r["stopped"]))
        rows.append(r)
    if rows:
        session.execute(insert(cast(Table, ProbeRow.__table__)), rows)
    return row.id


def next_session(session: Session, study_id: int, purpose: str) -> int:
    """The next free session number of a study's noise or confirmation runs (0 first)."""
    last = session.scalars(select(MeasurementRow.session).where(
        MeasurementRow.study_id == study_id, MeasurementRow.purpose == purpose)
        .order_by(MeasurementRow.session.desc()).limit(1)).first()
    return 0 if last is None else int(last) + 1


def add_validation(
    session: Session,
    study_id: int,
    *,
    top: int,
    repeats: int,
    forced: bool,
    mismatch: str | None,
    profile: Mapping[str, Any] | None,
    hardware: Mapping[str, Any],
    software: Mapping[str, Any],
    summary: Mapping[str, Any] | None,
    metrics: Iterable[Mapping[str, Any]],
    started_at: Any = None,
) -> int:
    """Record one validation of a simulated study (the next session number) with its rows ``metrics``
    (``trial_id``, ``rank``, ``metric``, ``predicted``, ``measured``, ``runs``, ``note``); returns its id."""
    last = session.scalars(select(Validation.session).where(Validation.study_id == study_id)
                           .order_by(Validation.session.desc()).limit(1)).first()
    row = Validation(study_id=study_id, session=1 if last is None else int(last) + 1, top=int(top),
                     repeats=int(repeats), forced=bool(forced), mismatch=mismatch,
                     profile=json_safe(dict(profile)) if profile is not None else None,
                     hardware=json_safe(dict(hardware)), software=json_safe(dict(software)),
                     summary=json_safe(dict(summary)) if summary is not None else None,
                     started_at=started_at or utcnow(), finished_at=utcnow())
    session.add(row)
    session.flush()
    for m in metrics:
        runs = m.get("runs")
        session.add(ValidationMetric(
            validation_id=row.id, trial_id=int(m["trial_id"]), rank=int(m["rank"]), metric=str(m["metric"]),
            predicted=_finite(m.get("predicted")), measured=_finite(m.get("measured")),
            runs=[_finite(v) for v in runs] if runs is not None else None, note=m.get("note")))
    session.flush()
    return row.id


def add_plan(
    session: Session,
    *,
    model: str,
    workload: str,
    workload_source: str | None,
    n_requests: int,
    slo: Mapping[str, Any],
    profiles: Iterable[Mapping[str, Any]],
    base_config: Mapping[str, Any],
    software: Mapping[str, Any],
    wall_s: float,
    rows: Iterable[Mapping[str, Any]],
    created_at: Any = None,
) -> int:
    """Record one ``engine plan`` run with its priced configs; returns the plan's id.

    ``rows`` are :func:`engine.sim.plan.plan`'s, in printed order: ``profile``, ``knobs``, ``budget_gib``
    (``"all"`` where every expert is resident), ``hi``, ``missing`` (``"-"`` where none is), ``batching``,
    ``replicas``, the figures, and ``error`` where the config could not be priced.
    """
    plan = PlanRun(model=str(model), workload=str(workload), workload_source=workload_source,
                   n_requests=int(n_requests), slo=json_safe(dict(slo)),
                   profiles=[json_safe(dict(p)) for p in profiles], base_config=json_safe(dict(base_config)),
                   software=json_safe(dict(software)), wall_s=float(wall_s), created_at=created_at or utcnow())
    session.add(plan)
    session.flush()
    for seq, r in enumerate(rows):
        budget = r.get("budget_gib")
        missing = r.get("missing")
        bounded = r.get("capacity_bounded")
        session.add(PlanConfig(
            plan_id=plan.id, seq=seq, profile=str(r["profile"]), knobs=json_safe(dict(r.get("knobs") or {})),
            budget_gib=None if budget in (None, "all") else float(budget), hi_precision=str(r.get("hi", "auto")),
            missing_expert=None if missing in (None, "-") else str(missing),
            expert_batching=str(r.get("batching", "coalesced")), max_replicas=int(r.get("replicas", 0)),
            offline_tokens_per_s=_finite(r.get("offline_tokens_per_s")), ttft_p99_ms=_finite(r.get("ttft_p99_ms")),
            tpot_p99_ms=_finite(r.get("tpot_p99_ms")), capacity_rps=_finite(r.get("capacity_rps")),
            capacity_bounded=None if bounded is None else bool(bounded), error=r.get("error")))
    session.flush()
    return plan.id


# -------------------------------------------------------------------------------- reading back


def trial_result_dict(session: Session, trial_id: int) -> dict[str, Any]:
    """A stored trial in the shape of ``RunResult.to_dict()`` (requests also carry ``met_slo``)."""
    trial = _get_trial(session, trial_id)

    def records(row_model: Any, keys: tuple[str, ...], order: Any) -> list[dict[str, Any]]:
        rows = session.scalars(select(row_model).where(row_model.trial_id == trial_id).order_by(order))
        return [{k: getattr(r, k) for k in keys} for r in rows]

    return {
        "meta": trial.meta or {},
        "summary": trial.summary or {},
        "requests": records(RequestRow, (*_REQUEST_KEYS, "met_slo"), RequestRow.id),
        "steps": records(StepRow, _STEP_KEYS, StepRow.id),
        "telemetry": records(TelemetryRow, _TELEMETRY_KEYS, TelemetryRow.id),
        "expert_stats": records(ExpertStatRow, _EXPERT_KEYS, ExpertStatRow.id),
    }
