"""Reading studies back: ranking, the gain over baselines, and the exported config file.

Everything here reads our ``mt_`` tables only (no Optuna, no torch), so the dashboard can use it.
A study that was confirmed (``tuner confirm``, also the end of every ``tuner run``) ranks its
confirmed configs first, by their confirmed medians: those are the figures it exports. The exported
file is what ``engine run --config best.json`` loads: the engine config under ``engine_config``, plus
the model, workload, hardware and SLO it was tuned for and the confirmed figures with their intervals.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from db.models import Study, Trial
from db.store import json_safe
from engine.config import EngineConfig
from engine.metrics import column_metrics
from tuner import findings
from tuner.metrics import OBJECTIVES, gain, pareto_ranks
from tuner.space import flatten
from tuner.stats import within_noise

log = logging.getLogger(__name__)

_HASH_SUFFIX_CHARS = 8
#: Trial figures a report row carries.
HEADLINE = ("capacity_rps", "goodput_rps", "slo_attainment", "output_tokens_per_s", "ttft_p99_ms", "tpot_p99_ms",
            "e2e_p99_ms", "quality_top1_agreement")


class StudyNotFound(LookupError):  # noqa: N818 - reads as what the user hears
    """No study of that name; one line that lists the known ones."""


def find_study(session: Session, name: str) -> Study:
    """The study ``name``: the exact name, else the newest ``<name>-<space hash>``."""
    study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
    if study is not None:
        return study
    candidates = [
        s for s in session.scalars(select(Study).where(Study.name.startswith(f"{name}-", autoescape=True)))
        if len(s.name) == len(name) + 1 + _HASH_SUFFIX_CHARS
    ]
    if candidates:
        return max(candidates, key=lambda s: (s.created_at, s.id))
    known = session.scalars(select(Study.name).order_by(Study.id)).all()
    listed = ", ".join(known[-8:]) if known else "none yet (run `tuner run`)"
    raise StudyNotFound(f"no study {name!r} in the results database; studies: {listed}")


def objective_values(trial: Trial, objectives: Sequence[str]) -> list[float] | None:
    """The objective values a trial reported, or None (not complete, or not measured)."""
    if trial.state != "complete":
        return None
    stored = (trial.summary or {}).get("objectives") or {}
    values = []
    for o in objectives:
        v = stored.get(o, getattr(trial, o, None))
        if v is None:
            return None
        values.append(float(v))
    return values


def is_feasible(trial: Trial) -> bool:
    """A complete trial that met every SLO constraint."""
    return trial.state == "complete" and bool((trial.summary or {}).get("feasible", True))


def ranked_trials(session: Session, study: Study) -> list[Trial]:
    """Complete trials, best first: confirmed ones by their confirmed median (latest confirmation), then
    feasible before infeasible by the objective (several objectives: by Pareto front, then by the first
    objective)."""
    objectives = list(study.objectives)
    dirs = [OBJECTIVES[o] for o in objectives]
    trials = [t for t in session.scalars(select(Trial).where(Trial.study_id == study.id))
              if objective_values(t, objectives) is not None]
    out: list[Trial] = []
    conf = findings.confirmation(session, study) if len(objectives) == 1 else None
    if conf:
        medians = {c["trial_id"]: c["interval"]["median"] for c in conf["configs"] if c["interval"]}
        sign = -1.0 if dirs[0] == "maximize" else 1.0
        confirmed = sorted((t for t in trials if t.id in medians and is_feasible(t)),
                           key=lambda t: (sign * medians[t.id], t.number or 0))
        out += confirmed
        trials = [t for t in trials if t not in confirmed]
    for group in ([t for t in trials if is_feasible(t)], [t for t in trials if not is_feasible(t)]):
        points = [objective_values(t, objectives) or [] for t in group]
        ranks = pareto_ranks(points, dirs) if group else []
        sign = 1.0 if dirs[0] == "minimize" else -1.0
        order = sorted(range(len(group)), key=lambda i: (ranks[i], sign * points[i][0], group[i].number or 0))
        out += [group[i] for i in order]
    return out


def acting_changes(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs of a flat ``config`` that differ from ``defaults`` and act in it: a conditional knob
    whose parents do not enable it (an int4 group size without int4 experts, say) changes nothing."""
    from engine.config import knobs

    info = {k.key: k for k in knobs()}
    by_name = {k.name: k.key for k in info.values()}

    def acts(key: str) -> bool:
        k = info.get(key)
        return k is None or all(config.get(by_name.get(parent, parent), defaults.get(by_name.get(parent, parent)))
                                in values for parent, values in k.when.items())

    return {k: v for k, v in config.items() if k in defaults and v != defaults[k] and acts(k)}


def trial_row(trial: Trial, objectives: Sequence[str]) -> dict[str, Any]:
    """One trial as a JSON-able dict: state, objectives, headline metrics and changed knobs."""
    defaults = flatten(EngineConfig().to_dict())
    config = flatten(trial.config) if all(isinstance(v, dict) for v in (trial.config or {}).values()) else {}
    row: dict[str, Any] = {
        "number": trial.number,
        "state": trial.state,
        "baseline": trial.baseline_name,
        "feasible": is_feasible(trial),
        "objectives": dict(zip(objectives, objective_values(trial, objectives) or [], strict=False)),
        **{k: getattr(trial, k) for k in HEADLINE},
        "changed": acting_changes(config, defaults),
        "config_hash": trial.config_hash,
        "fidelity": trial.fidelity,
        "measured_s": trial.measured_s,
        "overhead_s": trial.overhead_s,
        "error": trial.error,
    }
    return json_safe(row)


def study_report(session: Session, study: Study, top: int = 5) -> dict[str, Any]:
    """What ``tuner show`` prints: the study, its best trials and the gain over each baseline."""
    objectives = list(study.objectives)
    dirs = [OBJECTIVES[o] for o in objectives]
    trials = list(session.scalars(select(Trial).where(Trial.study_id == study.id).order_by(Trial.number)))
    ranked = ranked_trials(session, study)
    best = ranked[0] if ranked else None  # feasible trials rank first
    best_values = objective_values(best, objectives) if best is not None else None
    states: dict[str, int] = {}
    for t in trials:
        states[t.state] = states.get(t.state, 0) + 1
    baselines = []
    for t in trials:
        if not t.is_baseline:
            continue
        values = objective_values(t, objectives)
        gains = {}
        for i, (o, d) in enumerate(zip(objectives, dirs, strict=True)):
            g = gain(best_values[i] if best_values else None, values[i] if values else None, d)
            gains[o] = None if g is None or math.isinf(g) else g
        baselines.append({**trial_row(t, objectives), "gain": gains})
    reconf = [float(t.summary["reconfigure_s"]) for t in trials
              if t.summary and t.summary.get("reconfigure_s") is not None]
    load = [float(t.meta["tuner"]["engine_load_s"]) for t in trials
            if t.meta and (t.meta.get("tuner") or {}).get("engine_load_s") is not None]
    conf = findings.confirmation(session, study) if len(objectives) == 1 else None
    noise = findings.noise_summary(session, study)
    values = findings.searched_values(session, study)
    from tuner.validate import validation_report  # it ranks trials with this module's ranked_trials

    return json_safe({
        "study": study.name,
        "settings": study.settings,
        "noise": noise,
        "confirmation": conf,
        "within_noise": within_noise(values, findings.noise(session, study)),
        "fidelity": findings.fidelity_stats(session, study),
        "time": findings.time_stats(session, study),
        "model": {"path": study.model.path, "arch": study.model.arch, "fingerprint": study.model.fingerprint},
        "workload": {"name": study.workload.name, "source": study.workload.source,
                     "requests": study.workload.n_requests},
        "backend": study.backend,
        "validation": validation_report(session, study) if study.backend == "sim" else None,
        "objectives": objectives,
        "directions": dirs,
        "slo": study.slo,
        "search_space_hash": study.search_space_hash,
        "hardware_fingerprint": (study.hardware or {}).get("fingerprint"),
        "created_at": study.created_at.isoformat() if study.created_at else None,
        "trials": {"total": len(trials), **states},
        "best": [trial_row(t, objectives) for t in ranked[:top]],
        "best_feasible": bool(best is not None and is_feasible(best)),
        "baselines": baselines,
        "engine_load_s": max(load) if load else None,
        "reconfigure_s": {"median": statistics.median(reconf), "max": max(reconf), "n": len(reconf)}
        if reconf else None,
    })


def list_studies(session: Session) -> list[dict[str, Any]]:
    """Every study with its size and best primary objective value."""
    out = []
    for study in session.scalars(select(Study).order_by(Study.id)):
        ranked = ranked_trials(session, study)
        n = len(list(session.scalars(select(Trial.id).where(Trial.study_id == study.id))))
        best = ranked[0] if ranked else None
        value = objective_values(best, study.objectives) if best is not None else None
        out.append(json_safe({
            "study": study.name,
            "model": study.model.path,
            "workload": study.workload.name,
            "objective": study.objectives[0] if study.objectives else None,
            "trials": n,
            "best": value[0] if value else None,
            "best_feasible": bool(best is not None and is_feasible(best)),
            "created_at": study.created_at.isoformat() if study.created_at else None,
        }))
    return out


def export_config(session: Session, study: Study, rank: int = 1) -> dict[str, Any]:
    """The file ``tuner export`` writes for the ``rank``-th best trial (1 = best).

    Raises ``LookupError`` (one line) when the study has fewer complete trials.
    """
    ranked = ranked_trials(session, study)
    if rank < 1 or rank > len(ranked):
        raise LookupError(f"study {study.name!r} has {len(ranked)} complete trials; --rank {rank} is out of range")
    trial = ranked[rank - 1]
    if not is_feasible(trial):
        log.warning("trial %s of %s did not meet the SLO; exporting it anyway", trial.number, study.name)
    config = EngineConfig.from_dict(trial.config, source=f"{study.name} trial {trial.number}")
    model = study.model
    workload = study.workload
    metrics = {m.name: getattr(trial, m.name) for m in column_metrics()}
    metrics["objectives"] = (trial.summary or {}).get("objectives")
    metrics["feasible"] = is_feasible(trial)
    conf = findings.confirmation(session, study) if len(study.objectives) == 1 else None
    confirmed = findings.confirmed_interval(conf, trial.number)
    gains = None
    if conf and conf["best"] and conf["best"]["number"] == trial.number:
        gains = [{"over": g["baseline"], **(g["gain"] or {}), "verdict": g["verdict"]} for g in conf["gains"]]
    return json_safe({
        "engine_config": config.to_dict(),
        "config_hash": config.config_hash(),
        "model": {"path": model.path, "fingerprint": model.fingerprint, "arch": model.arch,
                  "identity": model.identity},
        "workload": {"name": workload.name, "source": workload.source, "fingerprint": workload.fingerprint,
                     "n_requests": workload.n_requests, "duration_s": workload.duration_s},
        "hardware": study.hardware,
        "software": study.software,
        "slo": study.slo,
        "objectives": list(study.objectives),
        "metrics": metrics,
        "confirmed": confirmed.to_dict() if confirmed else None,
        "gains": gains,
        "noise": findings.noise_summary(session, study),
        "study": study.name,
        "trial": trial.number,
        "baseline": trial.baseline_name,
    })


def write_export(data: dict[str, Any], out: str | Path) -> Path:
    """Write an export dict as indented JSON; returns the path."""
    path = Path(out)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
