"""Every query the dashboard makes, in one place, cached and read-only.

The database engine is opened once per URL (``st.cache_resource``) with
:func:`db.session.make_readonly_engine`, so the dashboard can never write. Results are cached with
``st.cache_data(ttl=...)``: a short time for what a running study changes, longer for finished
trials. Every statement is a SQLAlchemy ``select`` with bound parameters; column and sort names
chosen in the UI are looked up in allow-lists, never pasted into SQL.

Pages never load more rows than they draw: counts, bests and histograms are aggregated in SQL;
per-request CDFs and scatter plots take evenly spaced ranks (``row_number() OVER (...)``) of a
trial's requests; step timelines are bucketed in time. Works on SQLite and PostgreSQL.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st
from sqlalchemy import (
    Boolean,
    Engine,
    Float,
    Integer,
    and_,
    case,
    cast,
    func,
    inspect,
    literal,
    or_,
    select,
    true,
)
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from db.models import (
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
    Workload,
)
from db.session import DatabaseError, make_readonly_engine, mask_url, resolve_url
from engine.metrics import column_metrics
from tuner.metrics import OBJECTIVES
from workloads.transform import COPY_MARK

log = logging.getLogger(__name__)

LIVE_TTL_S = 5
"""Cache time of what a running study changes (trial lists, counts, bests)."""
TTL_S = 60
"""Cache time of a finished trial's records, importances and exports."""
MAX_POINTS = 1000
"""Most points a per-request or per-step chart draws; larger trials are downsampled in SQL."""

STATES = ("complete", "running", "failed", "pruned", "infeasible")

#: Trial metrics a table may show or sort by: name -> column (every metric column of ``engine.metrics``,
#: plus how the trial was measured).
TRIAL_METRICS: dict[str, Any] = {
    **{m.name: getattr(Trial, m.name) for m in column_metrics()},
    "fidelity": Trial.fidelity,
    "measured_s": Trial.measured_s,
    "overhead_s": Trial.overhead_s,
}
TABLE_METRICS = ("capacity_rps", "goodput_rps", "slo_attainment", "output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms",
                 "e2e_p99_ms", "quality_top1_agreement", "peak_rss_bytes", "fidelity", "measured_s", "overhead_s")
SORTABLE = ("number", "state", *TRIAL_METRICS)
#: Per-request latencies a CDF can show.
REQUEST_LATENCIES = {"ttft_ms": RequestRow.ttft_ms, "tpot_ms": RequestRow.tpot_ms, "e2e_ms": RequestRow.e2e_ms}


# ------------------------------------------------------------------------------ connection


def db_url() -> str:
    """The database URL: ``$MOETUNE_DB``, else ``sqlite:///moetune.db`` (``db.session`` decides)."""
    return resolve_url(None)


def masked(url: str) -> str:
    """``url`` with its password hidden, for display."""
    return mask_url(url)


def db_label() -> str:
    """The database the dashboard reads, password hidden, for the sidebar (never raises)."""
    try:
        return mask_url(db_url())
    except DatabaseError as e:
        return f"unusable ({e})"


@st.cache_resource(show_spinner=False)
def get_engine(url: str) -> Engine:
    """A read-only engine for ``url``, opened once per URL (raises ``DatabaseError``)."""
    return make_readonly_engine(url)


def _frame(url: str, stmt: Any) -> pd.DataFrame:
    with get_engine(url).connect() as conn:
        result = conn.execute(stmt)
        return pd.DataFrame(result.fetchall(), columns=list(result.keys()))


def _scalar(url: str, stmt: Any) -> Any:
    with get_engine(url).connect() as conn:
        return conn.execute(stmt).scalar()


def _dialect(url: str) -> str:
    return get_engine(url).dialect.name


def _floor(url: str, expr: Any) -> ColumnElement[int]:
    """``floor(expr)`` as an integer, for bucketing non-negative values on both backends.

    SQLite may lack math functions; casting a non-negative real to INTEGER truncates, which is
    floor. PostgreSQL's cast rounds, so it gets ``floor`` first.
    """
    if _dialect(url) == "postgresql":
        return cast(func.floor(expr), Integer)
    return cast(expr, Integer)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def database_status(url: str) -> dict[str, Any]:
    """``{"state": "ok" | "error" | "empty", "message": ..., "studies": n}`` for ``url``."""
    where = mask_url(url)
    try:
        engine = get_engine(url)
        if not inspect(engine).has_table(Study.__tablename__):
            return {"state": "empty", "studies": 0,
                    "message": f"{where} has no moetune tables yet (no study was ever run on it)."}
        n = _scalar(url, select(func.count()).select_from(Study))
    except (DatabaseError, SQLAlchemyError) as e:
        return {"state": "error", "studies": 0, "message": " ".join(str(e).split())[:400]}
    if not n:
        return {"state": "empty", "studies": 0, "message": f"{where} holds no study yet."}
    return {"state": "ok", "studies": int(n), "message": where}


# ----------------------------------------------------------------------------------- studies


def _feasible() -> ColumnElement[bool]:
    """Whether a trial met every SLO constraint (``summary.feasible``; absent means met)."""
    return func.coalesce(Trial.summary["feasible"].as_boolean(), true())


def _objective(name: str) -> ColumnElement[float]:
    """A trial's value of objective ``name``: ``summary.objectives.<name>``, else its column."""
    stored = Trial.summary[("objectives", name)].as_float()
    column = TRIAL_METRICS.get(name)
    return func.coalesce(stored, column) if column is not None else stored


def _state_counts() -> list[Any]:
    return [func.sum(case((Trial.state == s, 1), else_=0)).label(s) for s in STATES]


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def studies_overview(url: str) -> pd.DataFrame:
    """One row per study, newest first: what was tuned, trial counts by state, best goodput
    (feasible trials) and its gain over the best baseline, all aggregated in SQL."""
    complete = Trial.state == "complete"
    per_study = (
        select(
            Trial.study_id,
            func.count().label("trials"),
            *_state_counts(),
            func.max(case((and_(complete, _feasible()), Trial.goodput_rps))).label("best_goodput_rps"),
            func.max(case((and_(complete, _feasible()), Trial.capacity_rps))).label("best_capacity_rps"),
            func.max(case((and_(complete, Trial.is_baseline), Trial.goodput_rps))).label("best_baseline_goodput_rps"),
            func.max(Trial.started_at).label("last_trial_at"),
        )
        .group_by(Trial.study_id)
        .subquery()
    )
    stmt = (
        select(
            Study.id, Study.name, Study.backend, Study.objectives, Study.slo, Study.hardware, Study.created_at,
            Model.path.label("model_path"), Model.arch.label("model_arch"), Model.identity.label("model_identity"),
            Workload.name.label("workload"), Workload.source.label("workload_source"),
            *[func.coalesce(per_study.c[c], 0).label(c) for c in ("trials", *STATES)],
            per_study.c.best_goodput_rps, per_study.c.best_capacity_rps, per_study.c.best_baseline_goodput_rps,
            per_study.c.last_trial_at,
        )
        .join(Model, Model.id == Study.model_id)
        .join(Workload, Workload.id == Study.workload_id)
        .outerjoin(per_study, per_study.c.study_id == Study.id)
        .order_by(Study.created_at.desc(), Study.id.desc())
    )
    df = _frame(url, stmt)
    if df.empty:
        return df
    df["model"] = [model_label(p, i) for p, i in zip(df.pop("model_path"), df.pop("model_identity"), strict=True)]
    df["hardware"] = df["hardware"].map(hardware_label)
    df["slo"] = df["slo"].map(slo_label)
    df["objectives"] = df["objectives"].map(lambda o: ", ".join(o or []))
    for column in ("best_goodput_rps", "best_capacity_rps", "best_baseline_goodput_rps"):
        df[column] = df[column].astype(float)
    best, base = df["best_goodput_rps"], df["best_baseline_goodput_rps"]
    df["gain_over_best_baseline"] = (best / base).where(base > 0)
    return df


def model_label(path: str | None, identity: dict[str, Any] | None) -> str:
    """How a user named the model (``builtin:...`` or a directory), else its path."""
    return str((identity or {}).get("model") or path or "?")


def hardware_label(hw: dict[str, Any] | None) -> str:
    """``NVIDIA H200 x1 + 16 cores`` or ``Intel Xeon ... (2 cores)``."""
    hw = hw or {}
    gpu = hw.get("gpu")
    cores = hw.get("cpu_cores")
    if isinstance(gpu, dict) and gpu.get("name"):
        count = gpu.get("count") or 1
        return f"{gpu['name']} x{count}" + (f" + {cores} cores" if cores else "")
    cpu = str(hw.get("cpu_model") or "CPU")
    return f"{cpu} ({cores} cores)" if cores else cpu


def slo_label(slo: dict[str, Any] | None) -> str:
    """``ttft_p99_ms<=1000, tpot_p99_ms<=100, attainment>=0.9`` (the tuner's own wording)."""
    from tuner.slo import parse_slo

    try:
        return parse_slo(data=slo or {}).describe()
    except ValueError:
        return ", ".join(f"{k}={v}" for k, v in (slo or {}).items()) or "none"


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def study_names(url: str) -> list[str]:
    """Every study name, newest first."""
    stmt = select(Study.name).order_by(Study.created_at.desc(), Study.id.desc())
    return [str(n) for n in _frame(url, stmt)["name"]]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def study_info(url: str, name: str) -> dict[str, Any] | None:
    """The study ``name`` with its model and workload, or None."""
    stmt = (
        select(Study.id, Study.name, Study.optuna_study_name, Study.backend, Study.objectives, Study.slo,
               Study.hardware, Study.software, Study.search_space_hash, Study.created_at,
               Model.path.label("model_path"), Model.arch.label("model_arch"), Model.identity.label("model_identity"),
               Model.fingerprint.label("model_fingerprint"),
               Workload.id.label("workload_id"), Workload.name.label("workload"),
               Workload.source.label("workload_source"), Workload.fingerprint.label("workload_fingerprint"),
               Workload.n_requests.label("workload_requests"))
        .join(Model, Model.id == Study.model_id)
        .join(Workload, Workload.id == Study.workload_id)
        .where(Study.name == name)
    )
    df = _frame(url, stmt)
    if df.empty:
        return None
    info = df.iloc[0].to_dict()
    info["objectives"] = list(info["objectives"] or [])
    info["directions"] = [OBJECTIVES.get(o, "maximize") for o in info["objectives"]]
    info["model"] = model_label(info["model_path"], info["model_identity"])
    return info


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def state_counts(url: str, study_id: int) -> dict[str, int]:
    """Trials of a study by state (every state present, zeros included), and ``total``."""
    stmt = select(func.count().label("total"), *_state_counts()).where(Trial.study_id == study_id)
    row = _frame(url, stmt).iloc[0]
    return {k: int(row[k] or 0) for k in ("total", *STATES)}


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def objective_points(url: str, study_id: int, objectives: tuple[str, ...]) -> pd.DataFrame:
    """Every trial of a study, by number: state, baseline, feasibility, the objectives (``obj_0``,
    ``obj_1``, ...; complete trials only) and the headline metrics. Few columns per trial, so a
    study of thousands of trials stays small."""
    complete = Trial.state == "complete"
    stmt = (
        select(
            Trial.number, Trial.state, Trial.is_baseline, Trial.baseline_name,
            case((complete, _feasible()), else_=literal(False, Boolean)).label("feasible"),
            *[case((complete, _objective(o))).label(f"obj_{i}") for i, o in enumerate(objectives)],
            Trial.goodput_rps, Trial.capacity_rps, Trial.output_tokens_per_s, Trial.slo_attainment,
            Trial.ttft_p99_ms, Trial.tpot_p99_ms, Trial.e2e_p99_ms,
        )
        .where(Trial.study_id == study_id)
        .order_by(Trial.number, Trial.id)
    )
    df = _frame(url, stmt)
    df["feasible"] = df["feasible"].fillna(False).astype(bool)
    df["is_baseline"] = df["is_baseline"].fillna(False).astype(bool)
    for c in df.columns:
        if c.startswith("obj_"):
            df[c] = df[c].astype(float)
    return df


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def trials_table(url: str, study_id: int, states: tuple[str, ...] = (), kind: str = "all",
                 sort_by: str = "number", descending: bool = False, limit: int = 200,
                 offset: int = 0) -> tuple[pd.DataFrame, int]:
    """One page of a study's trials, filtered and sorted in SQL, and the number that matched.

    ``kind``: ``all``, ``baselines``, ``searched``, ``feasible`` or ``infeasible`` (complete trials
    that missed the SLO). ``sort_by``: ``number``, ``state`` or a name in :data:`TRIAL_METRICS`.
    """
    if sort_by not in SORTABLE:
        raise ValueError(f"cannot sort trials by {sort_by!r}; choose one of {', '.join(SORTABLE)}")
    where: list[Any] = [Trial.study_id == study_id]
    if states:
        where.append(Trial.state.in_(states))
    complete = Trial.state == "complete"
    kinds = {
        "all": None,
        "baselines": Trial.is_baseline,
        "searched": Trial.is_baseline.is_(False),
        "feasible": and_(complete, _feasible()),
        "infeasible": and_(complete, _feasible().is_(False)),
    }
    if kind not in kinds:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(kinds)}")
    if kinds[kind] is not None:
        where.append(kinds[kind])
    column = {"number": Trial.number, "state": Trial.state, **TRIAL_METRICS}[sort_by]
    order = column.desc().nulls_last() if descending else column.asc().nulls_last()
    stmt = (
        select(Trial.number, Trial.state, Trial.baseline_name.label("baseline"),
               case((complete, _feasible()), else_=literal(False, Boolean)).label("meets_slo"),
               *[TRIAL_METRICS[m].label(m) for m in TABLE_METRICS], Trial.config_hash, Trial.error,
               Trial.started_at, Trial.finished_at)
        .where(*where)
        .order_by(order, Trial.number)
        .limit(limit)
        .offset(offset)
    )
    total = _scalar(url, select(func.count()).select_from(Trial).where(*where))
    df = _frame(url, stmt)
    df["meets_slo"] = df["meets_slo"].fillna(False).astype(bool)
    return df, int(total or 0)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def top_configs(url: str, study_id: int, objective: str, direction: str, limit: int = 300) -> pd.DataFrame:
    """The ``limit`` best complete trials by ``objective`` with their configs (for parallel
    coordinates): number, baseline, feasible, ``value`` and ``config``."""
    value = _objective(objective)
    order = value.desc() if direction == "maximize" else value.asc()
    stmt = (
        select(Trial.number, Trial.baseline_name.label("baseline"), _feasible().label("feasible"),
               value.label("value"), Trial.config)
        .where(Trial.study_id == study_id, Trial.state == "complete", value.is_not(None))
        .order_by(order.nulls_last(), Trial.number)
        .limit(limit)
    )
    df = _frame(url, stmt)
    df["feasible"] = df["feasible"].fillna(False).astype(bool)
    return df


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def findings(url: str, study_name: str) -> dict[str, Any]:
    """What the study found (``tuner.findings``, the same figures ``tuner show`` prints): ``noise``,
    ``confirmation`` (the latest session), ``fidelity``, ``time`` and ``within_noise``."""
    from tuner import findings as f
    from tuner.stats import within_noise

    with Session(get_engine(url)) as s:
        study = s.scalars(select(Study).where(Study.name == study_name)).one()
        single = len(study.objectives) == 1
        noise = f.noise(s, study)
        return {
            "noise": f.noise_summary(s, study),
            "confirmation": f.confirmation(s, study) if single else None,
            "fidelity": f.fidelity_stats(s, study),
            "time": f.time_stats(s, study),
            "within_noise": within_noise(f.searched_values(s, study), noise),
        }


#: Columns of :func:`validation`'s rows.
VALIDATION_COLUMNS = ("trial", "number", "baseline", "metric", "predicted", "measured", "error")


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def validation(url: str, study_name: str) -> dict[str, Any] | None:
    """The latest live validation of a simulated study (``tuner.validate.validation_report``, what
    ``tuner validate`` printed), or None: the report under ``report`` and one row per trial and metric
    under ``rows`` (:data:`VALIDATION_COLUMNS`: predicted, measured and the signed relative error)."""
    from tuner.validate import validation_report

    with Session(get_engine(url)) as s:
        study = s.scalars(select(Study).where(Study.name == study_name)).one()
        report = validation_report(s, study)
    if report is None:
        return None
    rows = [{"trial": f"trial {t['trial']}" + (f" [{t['baseline']}]" if t["baseline"] else ""), "number": t["trial"],
             "baseline": t["baseline"], "metric": m, "predicted": t["predicted"].get(m),
             "measured": t["measured"].get(m), "error": t["error"].get(m)}
            for t in report["trials"] for m in report["metrics"]]
    frame = pd.DataFrame(rows, columns=list(VALIDATION_COLUMNS))
    for c in ("predicted", "measured", "error"):
        frame[c] = frame[c].astype(float)
    return {"report": report, "rows": frame}


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def search_values(url: str, study_id: int) -> pd.DataFrame:
    """Each trial's search on the whole workload (``mt_measurements``, purpose search, fidelity 1):
    number, baseline, state, feasible, ``value`` (None when it stopped early) and ``upper_bound``."""
    stmt = (
        select(Trial.number, Trial.state, Trial.is_baseline, Trial.baseline_name,
               case((Trial.state == "complete", _feasible()), else_=literal(False, Boolean)).label("feasible"),
               MeasurementRow.value, MeasurementRow.upper_bound, MeasurementRow.stopped_early)
        .join(MeasurementRow, MeasurementRow.trial_id == Trial.id)
        .where(Trial.study_id == study_id, MeasurementRow.purpose == "search", MeasurementRow.fidelity >= 1.0)
        .order_by(Trial.number, MeasurementRow.id)
    )
    df = _frame(url, stmt)
    for c in ("feasible", "is_baseline", "stopped_early"):
        df[c] = df[c].fillna(False).astype(bool)
    for c in ("value", "upper_bound"):
        df[c] = df[c].astype(float)
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def trial_probes(url: str, trial_id: int) -> pd.DataFrame:
    """Every replay of every measurement of a trial, in run order: the measurement's purpose, session,
    repeat, fidelity and value, and the probe's rate, attainment, verdict and percentiles."""
    stmt = (
        select(MeasurementRow.id.label("measurement"), MeasurementRow.purpose, MeasurementRow.session,
               MeasurementRow.repeat, MeasurementRow.fidelity, MeasurementRow.value.label("measured_value"),
               MeasurementRow.stopped_early, ProbeRow.seq, ProbeRow.rate_scale, ProbeRow.rate_rps, ProbeRow.attainment,
               ProbeRow.met, ProbeRow.stopped, ProbeRow.n_requests, ProbeRow.duration_s, ProbeRow.goodput_rps,
               ProbeRow.ttft_p99_ms, ProbeRow.tpot_p99_ms)
        .join(ProbeRow, ProbeRow.measurement_id == MeasurementRow.id)
        .where(MeasurementRow.trial_id == trial_id)
        .order_by(MeasurementRow.id, ProbeRow.seq)
    )
    df = _frame(url, stmt)
    for c in ("met", "stopped", "stopped_early"):
        df[c] = df[c].fillna(False).astype(bool)
    return df


@st.cache_resource(show_spinner=False)
def _optuna_storage(url: str) -> Any:
    """Optuna's RDB storage on the same database, read-only (no table creation, no heartbeats),
    opened once per URL."""
    import optuna

    engine = get_engine(url)
    kwargs: dict[str, Any] = {}
    if engine.dialect.name == "postgresql":
        kwargs["connect_args"] = {"options": "-c default_transaction_read_only=on"}
    storage_url = engine.url.render_as_string(hide_password=False)
    return optuna.storages.RDBStorage(storage_url, engine_kwargs=kwargs, skip_table_creation=True)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def param_importance(url: str, optuna_study_name: str, objective_index: int, direction: str) -> dict[str, Any]:
    """Parameter importance of one objective (Optuna's PED-ANOVA, ``tuner.importance``).

    Returns ``{"importances": {knob: share}, "n_trials": n}`` or ``{"message": why not}``.
    """
    import optuna

    from tuner.importance import param_importance as importance_of

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        study = optuna.load_study(study_name=optuna_study_name, storage=_optuna_storage(url))
    except Exception as e:  # noqa: BLE001 - Optuna and SQLAlchemy raise many kinds
        log.info("no parameter importance for %s: %s", optuna_study_name, e)
        return {"message": f"cannot read Optuna study {optuna_study_name!r}: {' '.join(str(e).split())[:200]}"}
    imp = importance_of(study, objective_index, direction)
    if "message" in imp:
        imp["message"] = f"parameter importance {imp['message']}."
    return imp


# ------------------------------------------------------------------------------------- trials


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def trial_list(url: str, study_id: int) -> pd.DataFrame:
    """Number, state, baseline, feasibility and goodput of every trial, for pickers."""
    stmt = (
        select(Trial.number, Trial.state, Trial.baseline_name.label("baseline"),
               case((Trial.state == "complete", _feasible()), else_=literal(False, Boolean)).label("feasible"),
               Trial.goodput_rps)
        .where(Trial.study_id == study_id, Trial.number.is_not(None))
        .order_by(Trial.number)
    )
    df = _frame(url, stmt)
    df["feasible"] = df["feasible"].fillna(False).astype(bool)
    return df


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def trial_detail(url: str, study_id: int, number: int) -> dict[str, Any] | None:
    """Every column of one trial (config, summary, meta, error), or None."""
    stmt = select(*Trial.__table__.columns).where(Trial.study_id == study_id, Trial.number == number)
    df = _frame(url, stmt)
    if df.empty:
        return None
    row = df.iloc[0].to_dict()
    return {k: (None if _is_nan(v) else v) for k, v in row.items()}


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def trials_by_number(url: str, study_id: int, numbers: tuple[int, ...]) -> pd.DataFrame:
    """Some trials of a study (for comparison): every metric, the config and the summary."""
    stmt = (
        select(Trial.id, Trial.number, Trial.state, Trial.baseline_name.label("baseline"),
               case((Trial.state == "complete", _feasible()), else_=literal(False, Boolean)).label("feasible"),
               *[c.label(n) for n, c in TRIAL_METRICS.items()], Trial.config, Trial.summary, Trial.error)
        .where(Trial.study_id == study_id, Trial.number.in_(numbers))
        .order_by(Trial.number)
    )
    df = _frame(url, stmt)
    df["feasible"] = df["feasible"].fillna(False).astype(bool)
    return df


def _own_requests(originals_only: bool) -> list[ColumnElement[bool]]:
    """Where-clauses for the workload's own requests of a replay, not the copies a capacity probe added to
    reach its minimum span (``workloads.transform.cycle``); none when ``originals_only`` is False."""
    return [RequestRow.request_id.not_like(f"%{COPY_MARK}%")] if originals_only else []


@st.cache_data(ttl=TTL_S, show_spinner=False)
def request_counts(url: str, trial_id: int, originals_only: bool = False) -> dict[str, Any]:
    """Requests of a trial: total, met and missed the SLO, unknown, and the last finish time."""
    stmt = select(
        func.count().label("total"),
        func.sum(case((RequestRow.met_slo.is_(True), 1), else_=0)).label("met"),
        func.sum(case((RequestRow.met_slo.is_(False), 1), else_=0)).label("missed"),
        func.max(func.coalesce(RequestRow.finish_s, RequestRow.arrival_s)).label("end_s"),
        func.max(RequestRow.arrival_s).label("last_arrival_s"),
    ).where(RequestRow.trial_id == trial_id, *_own_requests(originals_only))
    row = _frame(url, stmt).iloc[0]
    total = int(row["total"] or 0)
    met, missed = int(row["met"] or 0), int(row["missed"] or 0)
    return {"total": total, "met": met, "missed": missed, "unknown": total - met - missed,
            "end_s": float(row["end_s"] or 0.0), "last_arrival_s": float(row["last_arrival_s"] or 0.0)}


def _ranked(url: str, table: Any, columns: Sequence[Any], where: Sequence[Any], order_by: Sequence[Any],
            max_points: int) -> tuple[pd.DataFrame, int]:
    """Evenly spaced ranks (first and last included) of the rows matching ``where`` in
    ``order_by`` order, at most about ``max_points``; ``rank`` is 1-based. Returns the rows and
    how many matched."""
    n = int(_scalar(url, select(func.count()).select_from(table).where(*where)) or 0)
    if n == 0:
        return pd.DataFrame(columns=[*(c.key for c in columns), "rank"]), 0
    step = max(1, math.ceil(n / max_points))
    inner = (
        select(*columns, func.row_number().over(order_by=list(order_by)).label("rank"))
        .where(*where)
        .subquery()
    )
    stmt = (
        select(inner)
        .where(or_((inner.c["rank"] - 1) % step == 0, inner.c["rank"] == n))
        .order_by(inner.c["rank"])
    )
    return _frame(url, stmt), n


@st.cache_data(ttl=TTL_S, show_spinner=False)
def latency_cdf(url: str, trial_id: int, metric: str, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Empirical CDF of one per-request latency (``ttft_ms``, ``tpot_ms`` or ``e2e_ms``):
    ``value`` and ``fraction`` (share of requests at or below it), from at most ``max_points``
    evenly spaced ranks computed in SQL."""
    column = REQUEST_LATENCIES.get(metric)
    if column is None:
        raise ValueError(f"metric={metric!r}: expected one of {', '.join(REQUEST_LATENCIES)}")
    df, n = _ranked(url, RequestRow, [column.label("value")], [RequestRow.trial_id == trial_id, column.is_not(None)],
                    [column, RequestRow.id], max_points)
    df["value"] = df["value"].astype(float)
    df["fraction"] = df.pop("rank").astype(float) / max(n, 1)
    df.attrs["n"] = n
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def requests_sample(url: str, trial_id: int, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Requests of a trial in arrival order, at most ``max_points`` evenly spaced ones:
    arrival, latencies, lengths and whether each met the SLO."""
    columns = [RequestRow.request_id, RequestRow.arrival_s, RequestRow.ttft_ms, RequestRow.tpot_ms,
               RequestRow.e2e_ms, RequestRow.prompt_tokens, RequestRow.output_tokens,
               RequestRow.finish_reason, RequestRow.met_slo]
    df, n = _ranked(url, RequestRow, columns, [RequestRow.trial_id == trial_id], [RequestRow.arrival_s, RequestRow.id],
                    max_points)
    df.attrs["n"] = n
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def requests_over_time(url: str, trial_id: int, buckets: int = 60, originals_only: bool = False) -> pd.DataFrame:
    """Requests per arrival-time bucket, met and missed (GROUP BY in SQL): ``t_s`` (bucket
    start), ``width_s``, ``requests``, ``met``, ``missed``; ``originals_only``: the workload's own requests."""
    counts = request_counts(url, trial_id, originals_only)
    if counts["total"] == 0:
        return pd.DataFrame(columns=["t_s", "width_s", "requests", "met", "missed"])
    buckets = min(buckets, max(5, counts["total"] // 3))  # a few requests per bucket at least
    width = max(counts["last_arrival_s"] / buckets, 1e-3)
    bucket = _floor(url, RequestRow.arrival_s / width).label("bucket")
    stmt = (
        select(bucket, func.count().label("requests"),
               func.sum(case((RequestRow.met_slo.is_(True), 1), else_=0)).label("met"),
               func.sum(case((RequestRow.met_slo.is_(False), 1), else_=0)).label("missed"))
        .where(RequestRow.trial_id == trial_id, *_own_requests(originals_only))
        .group_by(bucket)
        .order_by(bucket)
    )
    df = _frame(url, stmt)
    df["t_s"] = df.pop("bucket").astype(float) * width
    df["width_s"] = width
    return df[["t_s", "width_s", "requests", "met", "missed"]]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def steps_timeline(url: str, trial_id: int, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Engine steps of a trial: ``start_s``, ``steps``, ``batch_seqs`` (mean), ``prefill_tokens``
    and ``decode_tokens`` (sums), ``duration_ms`` (mean) and ``duration_max_ms``. At most
    ``max_points`` rows: longer runs are bucketed in time in SQL."""
    n, end = _frame(url, select(func.count().label("n"), func.max(StepRow.start_s).label("end"))
                    .where(StepRow.trial_id == trial_id)).iloc[0]
    n = int(n or 0)
    if n <= max_points:
        stmt = (
            select(StepRow.start_s, literal(1).label("steps"), cast(StepRow.batch_seqs, Float).label("batch_seqs"),
                   StepRow.prefill_tokens, StepRow.decode_tokens, StepRow.duration_ms,
                   StepRow.duration_ms.label("duration_max_ms"))
            .where(StepRow.trial_id == trial_id)
            .order_by(StepRow.step, StepRow.id)
        )
        return _frame(url, stmt)
    width = max(float(end or 0.0) / max_points, 1e-6)
    bucket = _floor(url, StepRow.start_s / width).label("bucket")
    stmt = (
        select(func.min(StepRow.start_s).label("start_s"), func.count().label("steps"),
               func.avg(StepRow.batch_seqs).label("batch_seqs"), func.sum(StepRow.prefill_tokens).label("prefill_tokens"),
               func.sum(StepRow.decode_tokens).label("decode_tokens"), func.avg(StepRow.duration_ms).label("duration_ms"),
               func.max(StepRow.duration_ms).label("duration_max_ms"))
        .where(StepRow.trial_id == trial_id)
        .group_by(bucket)
        .order_by(bucket)
    )
    return _frame(url, stmt)


@st.cache_data(ttl=TTL_S, show_spinner=False)
def telemetry(url: str, trial_id: int, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Telemetry readings of a trial in time order (evenly spaced ranks when there are more than
    ``max_points``): ``t_s``, CPU %, RSS, GPU utilisation, memory and power."""
    columns = [TelemetryRow.t_s, TelemetryRow.cpu_percent, TelemetryRow.rss_bytes, TelemetryRow.gpu_util_percent,
               TelemetryRow.gpu_mem_bytes, TelemetryRow.gpu_power_w]
    df, _ = _ranked(url, TelemetryRow, columns, [TelemetryRow.trial_id == trial_id], [TelemetryRow.t_s, TelemetryRow.id],
                    max_points)
    return df.drop(columns="rank")


@st.cache_data(ttl=TTL_S, show_spinner=False)
def expert_stats(url: str, trial_id: int) -> pd.DataFrame:
    """Per MoE layer and expert: tokens routed, resident, precision and replicas (one row each)."""
    stmt = (
        select(ExpertStatRow.layer, ExpertStatRow.expert, ExpertStatRow.tokens, ExpertStatRow.resident,
               ExpertStatRow.precision, ExpertStatRow.replicas)
        .where(ExpertStatRow.trial_id == trial_id)
        .order_by(ExpertStatRow.layer, ExpertStatRow.expert)
    )
    df = _frame(url, stmt)
    df["resident"] = df["resident"].astype(bool)
    return df


# ---------------------------------------------------------------------------------- workloads


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def workloads_overview(url: str) -> pd.DataFrame:
    """Every workload with the studies and complete trials that replayed it."""
    per_study = (
        select(Trial.study_id, func.sum(case((Trial.state == "complete", 1), else_=0)).label("complete"))
        .group_by(Trial.study_id)
        .subquery()
    )
    stmt = (
        select(Workload.id, Workload.name, Workload.source, Workload.fingerprint, Workload.n_requests,
               Workload.duration_s, Workload.meta.label("meta"), Workload.created_at,
               func.count(Study.id).label("studies"),
               func.coalesce(func.sum(per_study.c.complete), 0).label("complete_trials"))
        .outerjoin(Study, Study.workload_id == Workload.id)
        .outerjoin(per_study, per_study.c.study_id == Study.id)
        .group_by(Workload.id)
        .order_by(Workload.created_at.desc(), Workload.id.desc())
    )
    return _frame(url, stmt)


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def workload_replay_trial(url: str, workload_id: int) -> int | None:
    """A complete trial that replayed the workload, the one with the most of its own requests (they stand
    for the workload when the workload file is not at hand; copies a probe added do not count)."""
    n_requests = (
        select(RequestRow.trial_id, func.count().label("n")).where(*_own_requests(True))
        .group_by(RequestRow.trial_id).subquery()
    )
    stmt = (
        select(Trial.id)
        .join(Study, Study.id == Trial.study_id)
        .join(n_requests, n_requests.c.trial_id == Trial.id)
        .where(Study.workload_id == workload_id, Trial.state == "complete")
        .order_by(n_requests.c.n.desc(), Trial.id)
        .limit(1)
    )
    trial_id = _scalar(url, stmt)
    return int(trial_id) if trial_id is not None else None


@st.cache_data(ttl=TTL_S, show_spinner=False)
def length_histogram(url: str, trial_id: int, column: str, bins: int = 40, originals_only: bool = False
                     ) -> pd.DataFrame:
    """Histogram of ``prompt_tokens`` or ``output_tokens`` over a trial's requests (GROUP BY in
    SQL): ``lo`` (bin start, tokens), ``width`` and ``requests``; ``originals_only``: the workload's own."""
    col = {"prompt_tokens": RequestRow.prompt_tokens, "output_tokens": RequestRow.output_tokens}.get(column)
    if col is None:
        raise ValueError(f"column={column!r}: expected prompt_tokens or output_tokens")
    own = _own_requests(originals_only)
    lo, hi = _frame(url, select(func.min(col).label("lo"), func.max(col).label("hi"))
                    .where(RequestRow.trial_id == trial_id, *own)).iloc[0]
    if lo is None or _is_nan(lo):
        return pd.DataFrame(columns=["lo", "width", "requests"])
    lo, hi = int(lo), int(hi)
    width = max(1, math.ceil((hi - lo + 1) / bins))
    bucket = _floor(url, (col - lo) / float(width)).label("bucket")
    stmt = (select(bucket, func.count().label("requests")).where(RequestRow.trial_id == trial_id, *own)
            .group_by(bucket).order_by(bucket))
    df = _frame(url, stmt)
    df["lo"] = lo + df.pop("bucket").astype(int) * width
    df["width"] = width
    return df[["lo", "width", "requests"]]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def workload_expert_popularity(url: str, workload_id: int) -> pd.DataFrame:
    """Tokens routed per (layer, expert), summed over every complete trial on the workload
    (SQL GROUP BY), with each expert's ``share`` of its layer and the number of ``trials``."""
    stmt = (
        select(ExpertStatRow.layer, ExpertStatRow.expert, func.sum(ExpertStatRow.tokens).label("tokens"),
               func.count(func.distinct(ExpertStatRow.trial_id)).label("trials"))
        .join(Trial, Trial.id == ExpertStatRow.trial_id)
        .join(Study, Study.id == Trial.study_id)
        .where(Study.workload_id == workload_id, Trial.state == "complete")
        .group_by(ExpertStatRow.layer, ExpertStatRow.expert)
        .order_by(ExpertStatRow.layer, ExpertStatRow.expert)
    )
    df = _frame(url, stmt)
    if not df.empty:
        df["tokens"] = df["tokens"].astype(float)
        df["share"] = df["tokens"] / df.groupby("layer")["tokens"].transform("sum").where(lambda s: s > 0)
    return df


@st.cache_data(ttl=600, show_spinner=False)
def workload_file(source: str | None, arrival_buckets: int = 60, bins: int = 40) -> dict[str, Any]:
    """What the workload file itself says, when ``source`` (``builtin:NAME`` or a path recorded
    by the tuner) is readable here: arrival rate per time bucket, length histograms and, with a
    router trace, per-layer expert hotness and its drift between token windows.

    Returns ``{"message": why not}`` when the file is not at hand. Only aggregates are kept.
    """
    import numpy as np

    from workloads.errors import WorkloadError
    from workloads.schema import load_workload

    if not source:
        return {"message": "the study did not record where the workload came from."}
    try:
        w = load_workload(source)
    except (WorkloadError, OSError, ValueError) as e:
        return {"message": f"workload file {source!r} is not readable here: {' '.join(str(e).split())[:200]}"}
    arrivals = np.asarray(w.arrivals_s, dtype=float)
    buckets = min(arrival_buckets, max(5, len(arrivals) // 3))  # a few requests per bucket at least
    width = max(float(arrivals.max(initial=0.0)) / buckets, 1e-3)
    counts = np.bincount((arrivals / width).astype(int))
    out: dict[str, Any] = {
        "name": w.name,
        "n_requests": len(w),
        "duration_s": float(w.duration_s),
        "rate_per_s": w.rate_per_s,
        "burstiness_cv": w.burstiness_cv,
        "arrivals": pd.DataFrame({"t_s": np.arange(len(counts)) * width, "requests": counts,
                                  "rate_per_s": counts / width}),
        "lengths": {name: _histogram(np.asarray(values, dtype=float), bins)
                    for name, values in (("prompt_tokens", w.prompt_lens), ("output_tokens", w.output_lens))},
        "router": None,
    }
    trace = w.router_trace
    if trace is not None and trace.n_tokens > 0:
        from workloads.router import drift_tv

        window = max(1, math.ceil(trace.n_tokens / 8))
        windows = trace.hotness_windows(window)  # [n_windows, layers, experts]
        per_window = [drift_tv(windows[i:i + 2]) for i in range(windows.shape[0] - 1)]
        out["router"] = {
            "hotness": trace.hotness(),  # [layers, experts]
            "window_tokens": window,
            "n_tokens": trace.n_tokens,
            "drift": pd.DataFrame([{"window": i + 1, "layer": layer, "drift_tv": float(d[layer])}
                                   for i, d in enumerate(per_window) for layer in range(len(d))]),
            "stats": trace.skew_stats(window),
            "model": dict(trace.model_identity),
        }
    return out


def _histogram(values: Any, bins: int) -> pd.DataFrame:
    import numpy as np

    if values.size == 0:
        return pd.DataFrame(columns=["lo", "width", "requests"])
    lo, hi = int(values.min()), int(values.max())
    width = max(1, math.ceil((hi - lo + 1) / bins))
    counts = np.bincount(((values - lo) // width).astype(int))
    return pd.DataFrame({"lo": lo + np.arange(len(counts)) * width, "width": width, "requests": counts})


# ------------------------------------------------------------------------------------- export


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def export_ranking(url: str, study_name: str) -> pd.DataFrame:
    """The study's complete trials in ``tuner export --rank`` order: ``rank``, number, baseline,
    feasible and the objectives (the tuner's own ranking, not a re-implementation)."""
    from tuner.export import find_study, is_feasible, objective_values, ranked_trials

    with Session(get_engine(url)) as s:
        study = find_study(s, study_name)
        objectives = list(study.objectives)
        rows = [{"rank": i, "number": t.number, "baseline": t.baseline_name, "meets_slo": is_feasible(t),
                 **dict(zip(objectives, objective_values(t, objectives) or [], strict=False))}
                for i, t in enumerate(ranked_trials(s, study), start=1)]
    return pd.DataFrame(rows, columns=["rank", "number", "baseline", "meets_slo", *objectives])


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def export_text(url: str, study_name: str, rank: int = 1) -> str:
    """The file ``tuner export --study NAME --rank RANK`` writes, byte for byte (the tuner's own
    ``export_config`` and ``write_export``). Raises ``LookupError`` for a rank out of range."""
    from tuner.export import export_config, find_study, write_export

    with Session(get_engine(url)) as s:
        data = export_config(s, find_study(s, study_name), rank=rank)
    with tempfile.TemporaryDirectory() as tmp:
        return write_export(data, Path(tmp) / "export.json").read_text()



# ------------------------------------------------------------------------------------- plans

#: Columns of a plan's configs as ``engine plan`` prints them (the page's table and the charts read these).
PLAN_COLUMNS = ("profile", "budget_gib", "hi_precision", "missing_expert", "expert_batching", "max_replicas",
                "offline_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms", "capacity_rps", "capacity_bounded", "error")


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def plans_status(url: str) -> dict[str, Any]:
    """``{"state": "ok" | "error" | "empty", "message": ..., "plans": n}`` for ``url`` (studies play no part)."""
    where = mask_url(url)
    try:
        if not inspect(get_engine(url)).has_table(PlanRun.__tablename__):
            return {"state": "empty", "plans": 0, "message": f"{where} has no plan tables yet."}
        n = _scalar(url, select(func.count()).select_from(PlanRun))
    except (DatabaseError, SQLAlchemyError) as e:
        return {"state": "error", "plans": 0, "message": " ".join(str(e).split())[:400]}
    if not n:
        return {"state": "empty", "plans": 0, "message": f"{where} holds no plan yet."}
    return {"state": "ok", "plans": int(n), "message": where}


def profiles_label(profiles: list[Any] | None) -> str:
    """``h100-pcie (datasheet), rtx4090 (datasheet)``: each profile, uncalibrated ones marked."""
    return ", ".join(f"{p.get('name')}{'' if p.get('calibrated') else ' (datasheet)'}" for p in profiles or [])


@st.cache_data(ttl=LIVE_TTL_S, show_spinner=False)
def plans_overview(url: str) -> pd.DataFrame:
    """One row per stored plan, newest first: what was planned, on which profiles, configs priced and
    unpriced, the best capacity (aggregated in SQL)."""
    per_plan = (
        select(PlanConfig.plan_id, func.count().label("configs"),
               func.sum(case((PlanConfig.error.is_not(None), 1), else_=0)).label("unpriced"),
               func.max(PlanConfig.capacity_rps).label("best_capacity_rps"),
               func.max(PlanConfig.offline_tokens_per_s).label("best_offline_tokens_per_s"))
        .group_by(PlanConfig.plan_id).subquery()
    )
    stmt = (
        select(PlanRun.id, PlanRun.model, PlanRun.workload, PlanRun.n_requests, PlanRun.slo, PlanRun.profiles,
               PlanRun.wall_s, PlanRun.created_at,
               *[func.coalesce(per_plan.c[c], 0).label(c) for c in ("configs", "unpriced")],
               per_plan.c.best_capacity_rps, per_plan.c.best_offline_tokens_per_s)
        .outerjoin(per_plan, per_plan.c.plan_id == PlanRun.id)
        .order_by(PlanRun.created_at.desc(), PlanRun.id.desc())
    )
    df = _frame(url, stmt)
    if df.empty:
        return df
    df["slo"] = df["slo"].map(slo_label)
    df["profiles_label"] = df["profiles"].map(profiles_label)
    for column in ("best_capacity_rps", "best_offline_tokens_per_s"):
        df[column] = df[column].astype(float)
    return df


@st.cache_data(ttl=TTL_S, show_spinner=False)
def plan_configs(url: str, plan_id: int) -> pd.DataFrame:
    """Every config of plan ``plan_id`` in printed order (:data:`PLAN_COLUMNS` and ``knobs``)."""
    stmt = (select(PlanConfig.seq, PlanConfig.knobs, *[getattr(PlanConfig, c) for c in PLAN_COLUMNS])
            .where(PlanConfig.plan_id == plan_id).order_by(PlanConfig.seq))
    df = _frame(url, stmt)
    for column in ("budget_gib", "offline_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms", "capacity_rps"):
        df[column] = df[column].astype(float)
    return df
