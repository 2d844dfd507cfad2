"""The results database: typed SQLAlchemy models.

Optuna's RDB storage lives in the same database and owns unprefixed tables (``studies``,
``trials``, ``alembic_version``, ...), so every table of ours starts with ``mt_``. Migrations in
``db/migrations`` create these tables; a test checks that they match this module.

Ownership: a study owns its trials and validations, a trial owns its requests, steps, expert
statistics, telemetry and validated figures (``ON DELETE CASCADE``). Models and workloads are shared look-ups: deleting one that a
study still uses is refused. A plan (``engine plan``) stands alone and owns its priced configs.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    Index,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

TABLE_PREFIX = "mt_"

#: Deterministic constraint and index names, so that migrations can refer to them by name
#: (SQLite batch mode needs names to drop or alter a constraint).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TRIAL_STATES = ("running", "complete", "failed", "infeasible", "pruned")
#: Which path produced a study's results: the torch engine, the stub or the simulator (no tensors),
#: or a server measured over HTTP (`workloads replay --url`).
BACKENDS = ("live", "stub", "sim", "http")
#: Why a config was measured: by its trial's search, for the study's noise, or to confirm a gain.
PURPOSES = ("search", "noise", "confirm")

JSONDict = dict[str, Any]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what every ``*_at`` column stores)."""
    return datetime.now(UTC)


def _in(column: str, values: tuple[str, ...]) -> str:
    # A literal list in DDL (not user data): the allowed values of an enumerated column.
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    """Declarative base of every moetune table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        JSONDict: JSON,
        list[Any]: JSON,
        list[str]: JSON,
        list[float]: JSON,
        float: Double,
        datetime: DateTime(timezone=True),
    }


class Model(Base):
    """A model checkpoint, identified by a fingerprint of its config and weights."""

    __tablename__ = "mt_models"

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), unique=True)
    path: Mapped[str] = mapped_column(Text)
    arch: Mapped[str | None] = mapped_column(String(128))
    n_params: Mapped[int | None] = mapped_column(BigInteger)
    shapes: Mapped[JSONDict | None]
    identity: Mapped[JSONDict | None]
    """The whole identity dict the engine reported (columns above are copies of its keys)."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    studies: Mapped[list[Study]] = relationship(back_populates="model", passive_deletes="all")


class Workload(Base):
    """A request trace (synthetic, built in or imported), identified by a fingerprint."""

    __tablename__ = "mt_workloads"

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(255))
    source: Mapped[str | None] = mapped_column(Text)
    n_requests: Mapped[int | None]
    duration_s: Mapped[float | None]
    # ``metadata`` is reserved on declarative classes; the column keeps the plain name.
    meta: Mapped[JSONDict | None] = mapped_column("metadata")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    studies: Mapped[list[Study]] = relationship(back_populates="workload", passive_deletes="all")


class Study(Base):
    """One tuning study: what was tuned, on what, for which SLO; the Optuna study beside it."""

    __tablename__ = "mt_studies"
    __table_args__ = (CheckConstraint(_in("backend", BACKENDS), name="backend"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    optuna_study_name: Mapped[str] = mapped_column(String(512))
    model_id: Mapped[int] = mapped_column(ForeignKey("mt_models.id", ondelete="RESTRICT"), index=True)
    workload_id: Mapped[int] = mapped_column(ForeignKey("mt_workloads.id", ondelete="RESTRICT"), index=True)
    hardware: Mapped[JSONDict]
    hardware_hash: Mapped[str] = mapped_column(String(64))
    software: Mapped[JSONDict]
    slo: Mapped[JSONDict]
    objectives: Mapped[list[str]]
    backend: Mapped[str] = mapped_column(String(16))
    search_space_hash: Mapped[str] = mapped_column(String(64))
    settings: Mapped[JSONDict | None]
    """How the study measures: mode, rate scale, requests, fidelity rungs, noise repeats, capacity search."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    model: Mapped[Model] = relationship(back_populates="studies")
    workload: Mapped[Workload] = relationship(back_populates="studies")
    trials: Mapped[list[Trial]] = relationship(
        back_populates="study", cascade="all, delete-orphan", passive_deletes=True
    )
    validations: Mapped[list[Validation]] = relationship(
        back_populates="study", cascade="all, delete-orphan", passive_deletes=True
    )


class Trial(Base):
    """One configuration run (an Optuna trial or a baseline) and its summary metrics."""

    __tablename__ = "mt_trials"
    __table_args__ = (
        CheckConstraint(_in("state", TRIAL_STATES), name="state"),
        UniqueConstraint("study_id", "number"),
        # Also serves every lookup by study_id alone (leading column).
        Index(None, "study_id", "state"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("mt_studies.id", ondelete="CASCADE"))
    number: Mapped[int | None]
    """Optuna's trial number within the study."""
    config: Mapped[JSONDict]
    config_hash: Mapped[str] = mapped_column(String(64), index=True)
    state: Mapped[str] = mapped_column(String(16))
    is_baseline: Mapped[bool] = mapped_column(default=False)
    baseline_name: Mapped[str | None] = mapped_column(String(128))

    output_tokens_per_s: Mapped[float | None]
    requests_per_s: Mapped[float | None]
    goodput_rps: Mapped[float | None]
    slo_attainment: Mapped[float | None]
    ttft_p50_ms: Mapped[float | None]
    ttft_p90_ms: Mapped[float | None]
    ttft_p99_ms: Mapped[float | None]
    tpot_p50_ms: Mapped[float | None]
    tpot_p90_ms: Mapped[float | None]
    tpot_p99_ms: Mapped[float | None]
    e2e_p50_ms: Mapped[float | None]
    e2e_p90_ms: Mapped[float | None]
    e2e_p99_ms: Mapped[float | None]
    itl_p50_ms: Mapped[float | None]
    itl_p90_ms: Mapped[float | None]
    itl_p99_ms: Mapped[float | None]
    quality_top1_agreement: Mapped[float | None]
    quality_mean_kl: Mapped[float | None]
    peak_rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_device_mem_bytes: Mapped[int | None] = mapped_column(BigInteger)
    duration_s: Mapped[float | None]
    capacity_rps: Mapped[float | None]
    ep_ranks: Mapped[int | None]
    ep_imbalance_mean: Mapped[float | None]
    ep_imbalance_max: Mapped[float | None]
    ep_bytes_dispatched_per_step: Mapped[float | None]
    ep_bytes_combined_per_step: Mapped[float | None]
    fidelity: Mapped[float | None]
    """Share of the workload's requests the trial's last measurement replayed (1: the whole workload)."""
    measured_s: Mapped[float | None]
    """Seconds of replays (probes) the trial ran, over every fidelity."""
    overhead_s: Mapped[float | None]
    """Seconds of the trial outside replays and quality checks: reconfigure, warm-up, probe set-up."""
    summary: Mapped[JSONDict | None]
    """The whole ``RunResult.summary()`` dict; the columns above are copies of its main keys."""
    meta: Mapped[JSONDict | None]
    """``RunResult.meta``: model, config, hardware and software of this very run."""
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    study: Mapped[Study] = relationship(back_populates="trials")
    requests: Mapped[list[RequestRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", passive_deletes=True
    )
    steps: Mapped[list[StepRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", passive_deletes=True
    )
    expert_stats: Mapped[list[ExpertStatRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", passive_deletes=True
    )
    telemetry: Mapped[list[TelemetryRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", passive_deletes=True
    )
    measurements: Mapped[list[MeasurementRow]] = relationship(
        back_populates="trial", cascade="all, delete-orphan", passive_deletes=True
    )


class MeasurementRow(Base):
    """One measurement of a trial's config: a search at one fidelity, a noise repeat, a confirmation run.

    Noise and confirmation runs of a study form sessions (``session``: 0 for the noise, 1, 2, ... for each
    ``tuner confirm``); ``seq`` is the order they ran in within it (A B C A B C ...), ``repeat`` the round.
    """

    __tablename__ = "mt_measurements"
    __table_args__ = (
        CheckConstraint(_in("purpose", PURPOSES), name="purpose"),
        Index(None, "study_id", "purpose", "session"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("mt_studies.id", ondelete="CASCADE"))
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(16))
    session: Mapped[int] = mapped_column(default=0)
    repeat: Mapped[int] = mapped_column(default=0)
    seq: Mapped[int] = mapped_column(default=0)
    objective: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None]
    """The objective's value; None when the search stopped early (see ``upper_bound``)."""
    upper_bound: Mapped[float | None]
    """A search stopped early: the value it could not reach."""
    fidelity: Mapped[float]
    n_requests: Mapped[int]
    bounded: Mapped[bool | None]
    """Capacity: whether a probe missed above every probe that met (the knee was bracketed)."""
    stopped_early: Mapped[bool] = mapped_column(default=False)
    note: Mapped[str | None] = mapped_column(Text)
    runs_s: Mapped[float]
    overhead_s: Mapped[float]
    started_at: Mapped[datetime] = mapped_column(default=utcnow)

    trial: Mapped[Trial] = relationship(back_populates="measurements")
    probes: Mapped[list[ProbeRow]] = relationship(
        back_populates="measurement", cascade="all, delete-orphan", passive_deletes=True, order_by="ProbeRow.seq"
    )


class ProbeRow(Base):
    """One replay of a measurement: a capacity probe at one arrival rate, or a single run."""

    __tablename__ = "mt_probes"

    id: Mapped[int] = mapped_column(primary_key=True)
    measurement_id: Mapped[int] = mapped_column(ForeignKey("mt_measurements.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int]
    rate_scale: Mapped[float]
    rate_rps: Mapped[float | None]
    attainment: Mapped[float]
    met: Mapped[bool]
    stopped: Mapped[bool]
    """Stopped once its verdict was certain: its attainment is a bound, not the share of a full replay."""
    n_requests: Mapped[int]
    duration_s: Mapped[float]
    goodput_rps: Mapped[float | None]
    ttft_p99_ms: Mapped[float | None]
    tpot_p99_ms: Mapped[float | None]

    measurement: Mapped[MeasurementRow] = relationship(back_populates="probes")


class RequestRow(Base):
    """One request of a trial. Times in seconds from the start of the run."""

    __tablename__ = "mt_requests"

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"), index=True)
    request_id: Mapped[str] = mapped_column(String(255))
    tag: Mapped[str | None] = mapped_column(String(255))
    arrival_s: Mapped[float]
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    ttft_ms: Mapped[float | None]
    tpot_ms: Mapped[float | None]
    e2e_ms: Mapped[float | None]
    first_token_s: Mapped[float | None]
    finish_s: Mapped[float | None]
    finish_reason: Mapped[str] = mapped_column(String(32))
    met_slo: Mapped[bool | None]
    itl_ms: Mapped[list[float] | None]

    trial: Mapped[Trial] = relationship(back_populates="requests")


class StepRow(Base):
    """One engine step (one forward pass over the scheduled batch) of a trial."""

    __tablename__ = "mt_steps"
    __table_args__ = (Index(None, "trial_id", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"))
    step: Mapped[int]
    start_s: Mapped[float]
    duration_ms: Mapped[float]
    batch_seqs: Mapped[int]
    prefill_tokens: Mapped[int]
    decode_tokens: Mapped[int]
    # Expert parallelism (NULL with one rank): bytes between ranks and max/mean pairs per rank.
    ep_bytes_dispatched: Mapped[int | None] = mapped_column(BigInteger)
    ep_bytes_combined: Mapped[int | None] = mapped_column(BigInteger)
    ep_imbalance: Mapped[float | None]

    trial: Mapped[Trial] = relationship(back_populates="steps")


class ExpertStatRow(Base):
    """Tokens routed to one expert of one MoE layer during a trial, and where it lived."""

    __tablename__ = "mt_expert_stats"
    __table_args__ = (Index(None, "trial_id", "layer", "expert"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"))
    layer: Mapped[int]
    expert: Mapped[int]
    tokens: Mapped[int] = mapped_column(BigInteger)
    resident: Mapped[bool]
    precision: Mapped[str] = mapped_column(String(32))
    replicas: Mapped[int]

    trial: Mapped[Trial] = relationship(back_populates="expert_stats")


class TelemetryRow(Base):
    """A process and device reading ``t_s`` seconds from the start of a trial."""

    __tablename__ = "mt_telemetry"
    __table_args__ = (Index(None, "trial_id", "t_s"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"))
    t_s: Mapped[float]
    cpu_percent: Mapped[float]
    rss_bytes: Mapped[int] = mapped_column(BigInteger)
    gpu_util_percent: Mapped[float | None]
    gpu_mem_bytes: Mapped[int | None] = mapped_column(BigInteger)
    gpu_power_w: Mapped[float | None]

    trial: Mapped[Trial] = relationship(back_populates="telemetry")


class Validation(Base):
    """One ``tuner validate`` run: a simulated study's best trials re-run live on this machine, with the
    measuring settings the study stored. ``session`` numbers a study's validations 1, 2, ..."""

    __tablename__ = "mt_validations"
    __table_args__ = (UniqueConstraint("study_id", "session"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("mt_studies.id", ondelete="CASCADE"))
    session: Mapped[int]
    top: Mapped[int]
    """Trials asked for (``--top``); the metrics rows say which ran."""
    repeats: Mapped[int]
    """Live runs of each trial; the measured figure is their median."""
    forced: Mapped[bool] = mapped_column(default=False)
    """Run with ``--force`` although the profile's machine is not this one (``mismatch`` says why)."""
    mismatch: Mapped[str | None] = mapped_column(Text)
    profile: Mapped[JSONDict | None]
    """The profile that priced the study (``Profile.describe()``)."""
    hardware: Mapped[JSONDict]
    """This machine, where the live runs ran (``engine.hwinfo.hardware``)."""
    software: Mapped[JSONDict]
    summary: Mapped[JSONDict | None]
    """Median absolute error per metric and Spearman's rho of the objective over the trials."""
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    study: Mapped[Study] = relationship(back_populates="validations")
    metrics: Mapped[list[ValidationMetric]] = relationship(
        back_populates="validation", cascade="all, delete-orphan", passive_deletes=True,
        order_by="ValidationMetric.id"
    )


class ValidationMetric(Base):
    """One metric of one validated trial: what the simulator predicted and what the live runs measured."""

    __tablename__ = "mt_validation_metrics"
    __table_args__ = (UniqueConstraint("validation_id", "trial_id", "metric"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    validation_id: Mapped[int] = mapped_column(ForeignKey("mt_validations.id", ondelete="CASCADE"))
    trial_id: Mapped[int] = mapped_column(ForeignKey("mt_trials.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int]
    """The trial's rank in the study (1: the best)."""
    metric: Mapped[str] = mapped_column(String(64))
    predicted: Mapped[float | None]
    """The trial's simulated figure."""
    measured: Mapped[float | None]
    """The median of the live runs; None when none measured it (``note`` says why)."""
    runs: Mapped[list[float] | None]
    """Each live run's figure, in run order."""
    note: Mapped[str | None] = mapped_column(Text)

    validation: Mapped[Validation] = relationship(back_populates="metrics")


class PlanRun(Base):
    """One ``engine plan`` run: a grid of hybrid knobs of one model priced by the simulator on one or more
    hardware profiles (``engine/sim/plan.py``). Stands apart from studies: no trial, no Optuna study."""

    __tablename__ = "mt_plans"

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(512))
    """The model as the user named it (``shape:qwen3-30b-a3b``, a directory, ``builtin:...``)."""
    workload: Mapped[str] = mapped_column(String(256))
    """The workload's name."""
    workload_source: Mapped[str | None] = mapped_column(String(1024))
    """The workload as the user named it (``--workload``)."""
    n_requests: Mapped[int]
    """Requests replayed per simulated run (``--max-requests`` or the whole workload)."""
    slo: Mapped[JSONDict]
    """The SLO of the capacity column (``SloSpec.to_dict()``: bounds and attainment target)."""
    profiles: Mapped[list[Any]]
    """Each profile priced, in order: ``Profile.describe()`` (name, ``calibrated``, source, host, device)
    plus ``fast`` (the device, or the host of a CPU-only profile)."""
    base_config: Mapped[JSONDict]
    """The engine config the grid's knob overrides apply to (``EngineConfig.to_dict()``)."""
    software: Mapped[JSONDict]
    wall_s: Mapped[float]
    """Wall-clock seconds of the whole plan."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    configs: Mapped[list[PlanConfig]] = relationship(
        back_populates="plan", cascade="all, delete-orphan", passive_deletes=True, order_by="PlanConfig.seq"
    )


class PlanConfig(Base):
    """One priced config of a plan: its profile, knob overrides and every figure ``engine plan`` prints."""

    __tablename__ = "mt_plan_configs"
    __table_args__ = (UniqueConstraint("plan_id", "seq"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("mt_plans.id", ondelete="CASCADE"))
    seq: Mapped[int]
    """Position in the printed output (0 first, profiles in order)."""
    profile: Mapped[str] = mapped_column(String(128))
    """The profile's name (one of the plan's ``profiles``)."""
    knobs: Mapped[JSONDict]
    """The knob overrides of the plan's base config (``{}``: the base, every expert resident)."""
    budget_gib: Mapped[float | None]
    """Resident expert budget; None where every expert is resident (printed ``all``)."""
    hi_precision: Mapped[str] = mapped_column(String(16))
    missing_expert: Mapped[str | None] = mapped_column(String(16))
    """Where a missing expert runs (host, fetch, auto); None where none is missing (printed ``-``)."""
    expert_batching: Mapped[str] = mapped_column(String(16))
    """``coalesced`` or ``micro``."""
    max_replicas: Mapped[int]
    offline_tokens_per_s: Mapped[float | None]
    ttft_p99_ms: Mapped[float | None]
    """p99 TTFT at the workload's own rate."""
    tpot_p99_ms: Mapped[float | None]
    capacity_rps: Mapped[float | None]
    """The highest arrival rate meeting the SLO (0: even the lowest probed rate missed)."""
    capacity_bounded: Mapped[bool | None]
    """Whether a probe missed above it (False: a lower bound, no probe missed)."""
    error: Mapped[str | None] = mapped_column(Text)
    """Why the config could not be priced (its figures are then None)."""

    plan: Mapped[PlanRun] = relationship(back_populates="configs")
