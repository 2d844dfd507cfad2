"""What a study found, read back from the results database: noise, confirmed gains, time spent.

Everything here reads our ``mt_`` tables only (no Optuna, no torch), so ``tuner show``, ``tuner export``
and the dashboard give the same figures:

- :func:`noise`: the run-to-run spread of the objective on the study's machine, from the default
  config's search and its repeats;
- :func:`confirmation`: the latest ``tuner confirm`` session (also run at the end of every
  ``tuner run``): each config's median with an interval, and the gain of the best searched config
  over every baseline, paired by round;
- :func:`fidelity_stats`: how many searched trials the multi-fidelity search promoted to the whole
  workload, and the replay time it saved;
- :func:`time_stats`: replays, quality checks and overhead, per trial and in total.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from db.models import MeasurementRow, ProbeRow, Study, Trial
from tuner.metrics import OBJECTIVES
from tuner.stats import (
    NO_GAIN,
    Interval,
    Noise,
    describe_gain,
    gain_interval,
    interval,
    noise_of,
    verdict,
)

DEFAULTS = "defaults"


def direction_of(study: Study) -> str:
    return OBJECTIVES.get(study.objectives[0], "maximize") if study.objectives else "maximize"


def _better(a: float, b: float, direction: str) -> bool:
    return a > b if direction == "maximize" else a < b


def _measurements(session: Session, study: Study, purpose: str) -> list[MeasurementRow]:
    return list(session.scalars(select(MeasurementRow).where(
        MeasurementRow.study_id == study.id, MeasurementRow.purpose == purpose).order_by(MeasurementRow.id)))


def noise(session: Session, study: Study) -> Noise | None:
    """The default config's values: its search on the whole workload plus every noise repeat."""
    defaults = session.scalars(select(Trial).where(Trial.study_id == study.id, Trial.baseline_name == DEFAULTS)
                               .order_by(Trial.number)).first()
    if defaults is None:
        return None
    values: list[float | None] = []
    search = [m for m in session.scalars(select(MeasurementRow).where(
        MeasurementRow.trial_id == defaults.id, MeasurementRow.purpose == "search")) if m.fidelity >= 1.0]
    values += [m.value for m in search[-1:]]
    values += [m.value for m in _measurements(session, study, "noise")]
    return noise_of(values)


def noise_summary(session: Session, study: Study) -> dict[str, Any] | None:
    """:func:`noise` as a JSON-able dict, with the number of the default config's trial."""
    n = noise(session, study)
    if n is None:
        return None
    return {**n.to_dict(), "objective": study.objectives[0] if study.objectives else None}


def gain_over_zero(baseline: str, runs: int, best_lo: float, floor_rps: float | None,
                   met_rps: Sequence[float] = ()) -> dict[str, Any]:
    """The gain row over a baseline that met the target at no rate in some of its ``runs`` (``met_rps``: the
    capacities of the others, if any): bounded from below by the best config's lowest run over the highest
    capacity the baseline could have had in any run (a run at 0 missed at ``floor_rps`` and above). A gain
    when that bound exceeds 1, else no gain beyond noise."""
    zero = runs - len(met_rps)
    top = max([*met_rps, floor_rps or 0.0])
    bound = best_lo / top if top > 0 and (floor_rps or met_rps) else None
    where = ("it met the target at no rate tried" + (f", down to {floor_rps:.3g} req/s," if floor_rps else "")
             + (f" in {runs} runs" if not met_rps else f" in {zero} of {runs} runs, and up to {max(met_rps):.4g} "
                f"req/s in the other{'s' if len(met_rps) > 1 else ''}"))
    if bound is not None and bound <= 1:
        return {"verdict": NO_GAIN, "lower_bound": bound, "floor_rps": floor_rps,
                "text": f"over {baseline}: {NO_GAIN} ({where}; the best config's lowest run {best_lo:.4g})"}
    return {"verdict": "gain", "lower_bound": bound, "floor_rps": floor_rps,
            "text": (f"more than x{bound:.3g} " if bound else "") + f"over {baseline}: {where}; "
                    f"the best config's lowest run {best_lo:.4g}"}


def _censored(row: dict[str, Any], best: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """A gain row where some runs met the target at the highest rate tried (their values are lower bounds of
    the capacity): the best config's make the gain a lower bound ("at least"), the baseline's an upper one;
    with both, the runs say nothing about the gain."""
    text = row["text"]
    n = len([v for v in best["values"] if v is not None])
    why = (f"{best['open_above']} of the best config's {n} runs met the target at the highest rate tried, "
           f"{max(v for v in best['values'] if v is not None):.4g}: beyond what the search can show")
    if best["open_above"] and other["open_above"]:
        return {"verdict": NO_GAIN, "lower_bound": None,
                "text": f"over {other['baseline']}: not comparable ({why}, and so did {other['open_above']} of "
                        f"{other['baseline']}'s)"}
    if other["open_above"]:
        return {"text": f"at most {text} ({other['open_above']} of {other['baseline']}'s runs met the target at "
                        "the highest rate tried)"}
    if text.startswith("more than"):
        return {"text": f"{text} ({why})"}
    g = row.get("gain")
    if g is None:
        return {}
    core = f"x{g['median']:.2f} over {other['baseline']} ({g['lo']:.2f}-{g['hi']:.2f}, {g['n']} runs each)"
    if row.get("verdict") == "gain":
        return {"text": f"at least {core} ({why})"}
    # Below or across 1 from a lower bound: the best config may be better than it measured, so no verdict.
    return {"verdict": NO_GAIN, "text": f"at least {core}: {NO_GAIN} ({why})"}


def _lowest_rate_missed(session: Session, rows: Sequence[MeasurementRow]) -> float | None:
    """The highest, over measurements that met the target at no rate, of the lowest rate each probed
    (req/s): below it a capacity of 0 says nothing."""
    lowest = session.execute(select(func.min(ProbeRow.rate_rps))
                             .where(ProbeRow.measurement_id.in_([r.id for r in rows]), ProbeRow.rate_rps.is_not(None))
                             .group_by(ProbeRow.measurement_id)).scalars().all()
    return max(lowest) if lowest else None


def _label(t: Trial) -> str:
    return f"trial {t.number}" + (f" [{t.baseline_name}]" if t.baseline_name else "")


def confirmation(session: Session, study: Study, session_no: int | None = None) -> dict[str, Any] | None:
    """The confirmation session ``session_no`` (default: the latest) summarised, or None.

    ``configs``: every confirmed trial with its values by round and median/interval; ``order``: the run
    order (trial numbers); ``best``: the confirmed searched trial with the best median (else the best
    baseline); ``gains``: that trial against each baseline, paired by round; ``export``: the trial with
    the best median of all (what ``tuner export`` writes).
    """
    rows = _measurements(session, study, "confirm")
    if not rows:
        return None
    if session_no is None:
        session_no = max(r.session for r in rows)
    rows = [r for r in rows if r.session == session_no]
    if not rows:
        return None
    direction = direction_of(study)
    trials = {t.id: t for t in session.scalars(select(Trial).where(Trial.id.in_({r.trial_id for r in rows})))}
    repeats = max(r.repeat for r in rows) + 1
    by_trial: dict[int, list[float | None]] = {}
    open_above: dict[int, int] = {}  # runs that met the target up to the highest rate tried: lower bounds
    for r in sorted(rows, key=lambda r: r.seq):
        values = by_trial.setdefault(r.trial_id, [None] * repeats)
        values[r.repeat] = r.value
        if r.bounded is False and r.value:
            open_above[r.trial_id] = open_above.get(r.trial_id, 0) + 1
    configs = []
    for trial_id, values in by_trial.items():
        t = trials[trial_id]
        measured = [v for v in values if v is not None]
        iv = interval(measured) if measured else None
        configs.append({"trial_id": trial_id, "number": t.number, "baseline": t.baseline_name, "label": _label(t),
                        "values": values, "search_value": _search_value(t, study),
                        "open_above": open_above.get(trial_id, 0),
                        "interval": iv.to_dict() if iv else None, "config": t.config})
    ranked = sorted((c for c in configs if c["interval"]),
                    key=lambda c: c["interval"]["median"], reverse=direction == "maximize")
    searched = [c for c in ranked if not c["baseline"]]
    best = searched[0] if searched else (ranked[0] if ranked else None)
    gains = []
    if best is not None:
        for c in configs:
            if not c["baseline"] or c["trial_id"] == best["trial_id"]:
                continue
            g = gain_interval(best["values"], c["values"], direction=direction)
            row = {"baseline": c["baseline"], "number": c["number"], "gain": g.to_dict() if g else None,
                   "verdict": verdict(g), "text": describe_gain(g, c["baseline"])}
            measured = [v for v in c["values"] if v is not None]
            if g is None and measured and min(measured) == 0 and best["interval"]["lo"] > 0:
                # A capacity of 0 in some runs: the baseline met the target at no rate the search tried
                # there; those runs' lowest rate (the highest over them) and the other runs' capacities
                # bound the gain from below.
                floor = _lowest_rate_missed(session, [r for r in rows if r.trial_id == c["trial_id"] and r.value == 0])
                row.update(gain_over_zero(c["baseline"], len(measured), best["interval"]["lo"], floor,
                                          [v for v in measured if v > 0]))
            if best["open_above"] or c["open_above"]:
                row.update(_censored(row, best, c))
            gains.append(row)
    order = [trials[r.trial_id].number for r in sorted(rows, key=lambda r: r.seq)]
    return {
        "session": session_no, "repeats": repeats, "objective": study.objectives[0] if study.objectives else None,
        "direction": direction, "order": order, "configs": configs, "best": best,
        "best_is_baseline": bool(best is not None and best["baseline"]),
        "export": ranked[0] if ranked else None, "gains": gains,
    }


def _search_value(t: Trial, study: Study) -> float | None:
    stored = ((t.summary or {}).get("objectives") or {})
    o = study.objectives[0] if study.objectives else None
    v = stored.get(o) if o else None
    return float(v) if v is not None else None


def confirmed_interval(conf: dict[str, Any] | None, number: int | None) -> Interval | None:
    """The confirmed median and interval of trial ``number`` in a :func:`confirmation` summary."""
    for c in (conf or {}).get("configs", []):
        if c["number"] == number and c["interval"]:
            return Interval(**c["interval"])
    return None


def fidelity_stats(session: Session, study: Study) -> dict[str, Any]:
    """Searched trials (not baselines) that were measured: how many reached the whole workload, how
    many stopped early on a prefix or on the whole workload (cannot beat the best so far, or cut by the
    pruner), and the replay time saved against the median replay time of a trial measured in full."""
    trials = list(session.scalars(select(Trial).where(Trial.study_id == study.id)))
    measured = [t for t in trials if not t.is_baseline and t.measured_s is not None
                and t.state in ("complete", "pruned")]
    promoted = [t for t in measured if (t.fidelity or 0) >= 1.0]
    stopped = [t for t in measured if t.state == "pruned"]
    full = [t.measured_s for t in trials if t.state == "complete" and t.measured_s is not None]
    typical = statistics.median(full) if full else None
    saved = sum(max(0.0, typical - (t.measured_s or 0.0)) for t in stopped) if typical is not None else None
    return {"searched": len(measured), "promoted": len(promoted), "stopped": len(stopped),
            "stopped_on_prefix": sum((t.fidelity or 0) < 1.0 for t in stopped),
            "completed": sum(t.state == "complete" for t in measured),
            "fraction_promoted": len(promoted) / len(measured) if measured else None,
            "typical_full_s": typical, "time_saved_s": saved, "replay_s": sum(t.measured_s or 0.0 for t in measured)}


def time_stats(session: Session, study: Study) -> dict[str, Any]:
    """Seconds of replays, quality checks and overhead over every measured trial, and per trial at worst."""
    trials = [t for t in session.scalars(select(Trial).where(Trial.study_id == study.id)) if t.measured_s]
    measured = sum(t.measured_s or 0.0 for t in trials)
    overhead = sum(t.overhead_s or 0.0 for t in trials)
    quality = sum(float((t.summary or {}).get("quality_s") or 0.0) for t in trials)
    shares = [(t.overhead_s or 0.0) / t.measured_s for t in trials if t.measured_s]
    repeats = [m for m in session.scalars(select(MeasurementRow).where(
        MeasurementRow.study_id == study.id, MeasurementRow.purpose != "search"))]
    return {"trials": len(trials), "measured_s": measured, "overhead_s": overhead, "quality_s": quality,
            "overhead_share": overhead / measured if measured else None,
            "overhead_share_max": max(shares) if shares else None,
            "repeats_runs_s": sum(m.runs_s for m in repeats), "repeats_overhead_s": sum(m.overhead_s for m in repeats)}


def searched_values(session: Session, study: Study) -> list[float]:
    """The objective of every complete trial on the whole workload (for the noise comparison)."""
    out = []
    for t in session.scalars(select(Trial).where(Trial.study_id == study.id, Trial.state == "complete")):
        v = _search_value(t, study)
        if v is not None:
            out.append(v)
    return out


def gain_lines(conf: dict[str, Any] | None) -> Sequence[str]:
    """The gains of a :func:`confirmation` summary as lines for a terminal."""
    return [g["text"] for g in (conf or {}).get("gains", [])]
