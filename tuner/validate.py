"""``tuner validate``: a simulated study's best trials re-run live on this machine, predicted against measured.

A study run with ``--backend sim`` ranks configs by what a profile's cost model predicts. Validating it
re-runs its ``top`` best complete trials (distinct configs) live, ``repeats`` times each, interleaved
(A B C C B A ...: ``tuner.stats.round_order``), with the measuring settings the study stored (``tuner.measure.MeasureSettings``: the
same objective, mode, requests and capacity search), and stores each trial's predicted and measured
figures (``mt_validations``, ``mt_validation_metrics``): the study's objectives, output tokens/s, p99 TTFT
and p99 TPOT. The error summary is ``engine validate-sim``'s (:mod:`engine.sim.validate`): the signed
relative error ``(predicted - measured) / measured`` of each figure, the median absolute error per metric
and Spearman's rho of the objective over the trials.

Live runs test the profile only on the machine it describes: a study priced by a profile calibrated
elsewhere, or by a datasheet profile, is refused unless forced (``--force``), and a forced validation
records that it was, and why the machines differ (:func:`engine.sim.profile.machine_mismatch`).

Everything is checked before the model loads, and nothing is stored unless every run has finished.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from db.models import Study, Trial, Validation
from engine.sim.profile import machine_mismatch
from engine.sim.validate import SPEARMAN_TARGET, TARGETS, median_abs_errors, relative_error, spearman

log = logging.getLogger(__name__)

#: Figures every validation compares besides the study's objectives.
METRICS = ("output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms")
DEFAULT_TOP = 3
#: Live runs of each trial (their median stands): one run of the same config moved by 1.2-1.8x within
#: five minutes on the development machine, as much as the errors a validation looks for.
DEFAULT_REPEATS = 3

Say = Callable[[str], None]


class ValidationRefused(ValueError):
    """A study that cannot be validated live here; one line naming the study and the value."""


def metrics_of(objectives: Sequence[str]) -> tuple[str, ...]:
    """The study's objectives, then :data:`METRICS` not among them."""
    return (*objectives, *(m for m in METRICS if m not in objectives))


@dataclass
class Pick:
    """One trial to validate: its rank, config and predicted figures."""

    trial_id: int
    number: int | None
    rank: int
    baseline: str | None
    config: dict[str, Any]
    predicted: dict[str, float | None]
    floor_rps: float | None = None
    """Capacity: a trial the simulator put at 0 req/s is searched from the lowest rate its search tried."""
    runs: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    """What a validation will run, read from the study and checked (:func:`plan`)."""

    study_id: int
    name: str
    model: str
    workload: str
    slo: dict[str, Any]
    settings: dict[str, Any]
    model_fingerprint: str
    objectives: list[str]
    profile: dict[str, Any] | None
    mismatch: str | None
    picks: list[Pick]

    @property
    def metrics(self) -> tuple[str, ...]:
        return metrics_of(self.objectives)


def predicted_figure(trial: Trial, metric: str) -> float | None:
    """A trial's figure ``metric``: its objective value, else the column or summary key of that name."""
    stored = ((trial.summary or {}).get("objectives") or {}).get(metric)
    if stored is None:
        stored = getattr(trial, metric, None) if hasattr(Trial, metric) else None
    if stored is None:
        stored = (trial.summary or {}).get(metric)
    return float(stored) if isinstance(stored, int | float) and not isinstance(stored, bool) else None


def pick_trials(session: Session, study: Study, top: int) -> list[Pick]:
    """The ``top`` best complete trials of ``study`` (``tuner.export.ranked_trials``: feasible first), one per
    config."""
    from tuner.export import ranked_trials

    metrics = metrics_of(list(study.objectives))
    out: list[Pick] = []
    seen: set[str] = set()
    for t in ranked_trials(session, study):
        if len(out) >= top:
            break
        if t.state != "complete" or t.config_hash in seen:
            continue
        seen.add(t.config_hash)
        predicted = {m: predicted_figure(t, m) for m in metrics}
        floor = (t.summary or {}).get("capacity_hi_rps") if predicted.get(study.objectives[0]) == 0 else None
        out.append(Pick(t.id, t.number, len(out) + 1, t.baseline_name, dict(t.config), predicted, floor))
    return out


def refusal(study: Study, model: str, mismatch: str | None, *, force: bool, has_weights: bool) -> str | None:
    """Why ``study`` cannot be validated live here (one line), or None. Pure: the caller looks up whether
    the model has weights and how the profile's machine differs from this one."""
    if study.backend != "sim":
        return (f"study {study.name!r} ran on the {study.backend} backend: tuner validate re-runs a simulated "
                "study (`tuner run --backend sim --profile P`) live")
    if not has_weights:
        return (f"study {study.name!r}: model {model} has no weights here (a shape or a config.json alone); "
                "live validation needs a checkpoint (config.json and safetensors)")
    if mismatch is not None and not force:
        return (f"study {study.name!r}: {mismatch}; live runs here would not test that profile (calibrate this "
                "machine with `engine calibrate --out profile.json` and run the study with it, or pass --force)")
    return None


def plan(session: Session, name: str, *, top: int, force: bool, here: Mapping[str, Any]) -> Plan:
    """Read study ``name`` and check it can be validated on the machine ``here``
    (:func:`engine.hwinfo.hardware`); raises :class:`ValidationRefused` (or ``StudyNotFound``)."""
    from engine.backend_sim import has_weights
    from tuner.export import find_study
    from tuner.repeats import settings_of

    if top < 1:
        raise ValidationRefused(f"--top {top}: must be >= 1")
    study = find_study(session, name)
    settings = settings_of(study)
    model = str(settings.get("model") or (study.model.identity or {}).get("model") or study.model.path)
    profile = settings.get("profile")
    mismatch = machine_mismatch(profile, dict(here)) if profile else "the study recorded no profile"
    why = refusal(study, model, mismatch, force=force, has_weights=study.backend == "sim" and has_weights(model))
    if why:
        raise ValidationRefused(why)
    picks = pick_trials(session, study, top)
    if not picks:
        raise ValidationRefused(f"study {study.name!r} has no complete trial to validate")
    return Plan(study.id, study.name, model, str(settings.get("workload") or study.workload.source), dict(study.slo or {}),
                settings, study.model.fingerprint, list(study.objectives), profile, mismatch, picks)


def run(p: Plan, *, repeats: int, say: Say = log.info) -> None:
    """Measure every pick live ``repeats`` times, interleaved, into its ``runs`` (a run that fails is noted
    and the others go on)."""
    from engine.backend import make_backend
    from engine.config import EngineConfig
    from tuner import capacity as cap
    from tuner.measure import Measurer, MeasureSettings
    from tuner.slo import parse_slo
    from tuner.stats import round_order
    from workloads.schema import load_workload

    workload = load_workload(p.workload)
    backend = make_backend(p.model, kind="live")
    fingerprint = backend.engine.fingerprint
    if fingerprint != p.model_fingerprint:
        raise ValidationRefused(f"{p.model}: its weights differ from those study {p.name!r} was simulated with "
                                f"(fingerprint {fingerprint}, study {p.model_fingerprint})")
    measurer = Measurer(backend, workload, parse_slo(data=p.slo), MeasureSettings.from_dict(p.settings))
    measurer.warm_up()
    objective = p.objectives[0]
    for r in range(repeats):
        for pick in round_order(p.picks, r):
            config = EngineConfig.from_dict(pick.config, source=f"trial {pick.number}")
            label = f"trial {pick.number}" + (f" [{pick.baseline}]" if pick.baseline else "")
            try:
                measurer.apply(config)
                start = pick.predicted.get(objective) or pick.floor_rps
                m = measurer.measure(1.0, start_rps=start, first_step=cap.WARM_STEP, floor_rps=pick.floor_rps)
            except Exception as e:  # noqa: BLE001 - one config the live engine refuses must not lose the others
                note = f"run {r + 1}: {' '.join(str(e).split()) or type(e).__name__}"
                log.warning("validate: %s %s", label, note)
                pick.notes.append(note)
                measurer.apply(config, fresh=True)
                continue
            figures = measurer.figures(m.best, None, m.capacity) if m.best is not None else {}
            values = dict(zip(m.objectives, m.values, strict=True)) if m.values is not None else {}
            if m.values is None:
                pick.notes.append(f"run {r + 1}: {m.reason or 'not measured'}")
            for metric in p.metrics:
                v = values.get(metric) if metric in m.objectives else figures.get(metric)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    pick.runs.setdefault(metric, []).append(float(v))
            got = values.get(objective)
            say(f"validate: run {r + 1}/{repeats}, {label}: {objective} measured "
                + (f"{got:.4g}" if got is not None else f"- ({m.reason or 'not measured'})")
                + f", predicted {_num(pick.predicted.get(objective))}")


def summarise(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], objective: str) -> dict[str, Any]:
    """The error summary of validated trials ``rows`` (each with ``predicted``, ``measured`` and ``error``
    dicts by metric): per metric the median absolute error (:func:`engine.sim.validate.median_abs_errors`),
    and Spearman's rho of ``objective``, predicted against measured (None below 3 trials)."""
    summary: dict[str, Any] = median_abs_errors([r["error"] for r in rows], tuple(metrics))
    both = [r for r in rows if r["predicted"].get(objective) is not None and r["measured"].get(objective) is not None]
    rho = spearman([r["predicted"][objective] for r in both], [r["measured"][objective] for r in both])
    summary["spearman"] = {"metric": objective, "rho": rho, "n": len(both), "target": SPEARMAN_TARGET,
                           "met": None if rho is None else rho >= SPEARMAN_TARGET}
    return summary


def _rows_of(p: Plan) -> list[dict[str, Any]]:
    rows = []
    for pick in p.picks:
        measured = {m: statistics.median(pick.runs[m]) if pick.runs.get(m) else None for m in p.metrics}
        rows.append({"predicted": pick.predicted, "measured": measured,
                     "error": {m: relative_error(pick.predicted.get(m), measured[m]) for m in p.metrics}})
    return rows


def store(db: Engine, p: Plan, *, top: int, repeats: int, forced: bool, started_at: Any) -> int:
    """Record the validation ``p`` has run (:func:`run`); returns its session number."""
    from db.session import session_scope
    from db.store import add_validation
    from engine.hwinfo import hardware, software

    rows = _rows_of(p)
    out = []
    for pick, row in zip(p.picks, rows, strict=True):
        note = "; ".join(pick.notes) or None
        out += [{"trial_id": pick.trial_id, "rank": pick.rank, "metric": m, "predicted": pick.predicted.get(m),
                 "measured": row["measured"][m], "runs": pick.runs.get(m, []), "note": note} for m in p.metrics]
    with session_scope(db) as s:
        vid = add_validation(s, p.study_id, top=top, repeats=repeats, forced=forced,
                             mismatch=p.mismatch, profile=p.profile, hardware=hardware(), software=software(),
                             summary=summarise(rows, p.metrics, p.objectives[0]), metrics=out, started_at=started_at)
        return int(s.get(Validation, vid).session)  # type: ignore[union-attr]


def validation_report(session: Session, study: Study, session_no: int | None = None) -> dict[str, Any] | None:
    """The latest validation of ``study`` (or session ``session_no``) as a JSON-able dict, or None: the profile,
    whether it was forced and why, one row per trial (predicted, measured, signed relative error and each
    run, by metric) and the summary."""
    q = select(Validation).where(Validation.study_id == study.id)
    q = q.where(Validation.session == session_no) if session_no is not None else q.order_by(
        Validation.session.desc()).limit(1)
    v = session.scalars(q).first()
    if v is None:
        return None
    numbers = {t.id: (t.number, t.baseline_name)
               for t in session.scalars(select(Trial).where(Trial.id.in_({m.trial_id for m in v.metrics})))}
    metrics = metrics_of(list(study.objectives))
    by_trial: dict[int, dict[str, Any]] = {}
    for m in v.metrics:
        number, baseline = numbers[m.trial_id]
        row = by_trial.setdefault(m.trial_id, {"trial": number, "baseline": baseline, "rank": m.rank, "predicted": {},
                                               "measured": {}, "error": {}, "runs": {}, "note": m.note})
        row["predicted"][m.metric] = m.predicted
        row["measured"][m.metric] = m.measured
        row["error"][m.metric] = relative_error(m.predicted, m.measured)
        row["runs"][m.metric] = list(m.runs or [])
    from db.store import json_safe

    return json_safe({
        "study": study.name, "session": v.session, "objective": study.objectives[0], "metrics": list(metrics),
        "top": v.top, "repeats": v.repeats, "forced": v.forced, "mismatch": v.mismatch, "profile": v.profile,
        "hardware_fingerprint": (v.hardware or {}).get("fingerprint"), "targets": dict(TARGETS),
        "trials": sorted(by_trial.values(), key=lambda r: r["rank"]), "summary": v.summary,
        "started_at": v.started_at.isoformat() if v.started_at else None,
        "finished_at": v.finished_at.isoformat() if v.finished_at else None,
    })


def validate_study(db: Engine, name: str, *, top: int, repeats: int, force: bool,
                   say: Say = log.info) -> dict[str, Any]:
    """``tuner validate``: check (:func:`plan`), run live (:func:`run`), store (:func:`store`); returns the
    stored validation (:func:`validation_report`)."""
    from db.models import utcnow
    from db.session import session_scope
    from engine.hwinfo import hardware

    if repeats < 1:
        raise ValidationRefused(f"--repeats {repeats}: must be >= 1")
    with session_scope(db) as s:
        p = plan(s, name, top=top, force=force, here=hardware())
    started = utcnow()
    if p.mismatch is not None:
        say(f"validate: forced: {p.mismatch}")
    say(f"validate: study {p.name}: {len(p.picks)} trials x {repeats} live runs on {p.model} and {p.workload}, "
        f"{p.settings.get('mode')} replay, objective {p.objectives[0]}")
    t = time.perf_counter()
    run(p, repeats=repeats, say=say)
    say(f"validate: {time.perf_counter() - t:.1f} s of live runs")
    session_no = store(db, p, top=top, repeats=repeats, forced=p.mismatch is not None, started_at=started)
    with session_scope(db) as s:
        report = validation_report(s, s.get(Study, p.study_id), session_no)  # type: ignore[arg-type]
    assert report is not None
    return report


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"
