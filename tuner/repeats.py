"""Repeated measurements that make a finding: the study's noise and the confirmation of its gains.

- :class:`NoisePhase`: after each of the first baselines, the default config is measured again, until it
  has ``repeats`` values (its own search included): D H D' L D'' ... The spread of those values is the
  noise of the objective on this machine now; the search uses it as its early-stop margin.
- :func:`confirm`: the top ``top`` searched configs and every baseline re-measured ``repeats`` times,
  interleaved, every other round reversed (A B C C B A ...: ``tuner.stats.round_order``), in one session whose order is recorded; ``tuner.findings.confirmation``
  summarises it (medians, intervals, gains paired by round).

Both measure on the whole workload, each search warm-started from the config's own value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import TrialState
from sqlalchemy import Engine, select

from db.models import Study, Trial
from db.session import session_scope
from db.store import next_session
from engine.config import EngineConfig
from tuner import capacity as cap
from tuner.findings import DEFAULTS, direction_of, noise
from tuner.measure import Measurer
from tuner.metrics import OBJECTIVES
from tuner.objective import ATTR_BASELINE
from tuner.record import Recorder
from tuner.stats import round_order

log = logging.getLogger(__name__)

Say = Callable[[str], None]


def _value(t: Trial, objective: str) -> float | None:
    v = ((t.summary or {}).get("objectives") or {}).get(objective)
    return float(v) if v is not None else None


class NoisePhase:
    """Interleaves the default config's repeats with the first baselines (the ``between`` hook of
    ``tuner.study.run_trials``)."""

    def __init__(self, measurer: Measurer, recorder: Recorder, repeats: int, say: Say = log.info) -> None:
        self.measurer = measurer
        self.recorder = recorder
        self.repeats = repeats
        self.say = say
        self._margin: float | None = None
        self.ran_s = 0.0

    def _state(self) -> tuple[Trial | None, int]:
        """The complete defaults trial (detached) and how many values the noise already has."""
        with session_scope(self.recorder.db) as s:
            study = s.get(Study, self.recorder.study_id)
            assert study is not None
            t = s.scalars(select(Trial).where(Trial.study_id == study.id, Trial.baseline_name == DEFAULTS,
                                              Trial.state == "complete").order_by(Trial.number)).first()
            n = noise(s, study)
            have = n.n if n is not None else (1 if t is not None else 0)
            if n is not None:
                self._margin = n.rel_spread
            if t is not None:
                s.expunge(t)
            return t, have

    def margin(self) -> float:
        """The early-stop margin: the noise's relative spread once measured, else the search tolerance."""
        if self._margin is None:
            self._state()
        return self._margin if self._margin is not None else self.measurer.settings.rel_tol

    def __call__(self, study: optuna.Study, last: optuna.trial.FrozenTrial | None = None) -> None:
        """After a trial: one more repeat of the defaults if the noise needs one and the trial was a
        baseline other than the defaults (or no baseline is left to interleave with)."""
        if self.repeats < 2:
            return
        trials = study.get_trials(deepcopy=False)
        waiting_baselines = [t for t in trials if t.state == TrialState.WAITING and t.user_attrs.get(ATTR_BASELINE)]
        after_baseline = last is not None and last.user_attrs.get(ATTR_BASELINE) not in (None, DEFAULTS)
        if not (after_baseline or not waiting_baselines):
            return
        defaults, have = self._state()
        if defaults is None or have >= self.repeats:
            return
        objective = self.measurer.settings.objectives[0]
        config = EngineConfig.from_dict(defaults.config, source=f"trial {defaults.number} [defaults]")
        self.measurer.apply(config)
        m = self.measurer.measure(1.0, start_rps=_value(defaults, objective),
                                  first_step=cap.rerun_step(self.measurer.settings.rel_tol))
        self.ran_s += m.wall_s
        self.recorder.measurement(defaults.id, "noise", m, session_no=0, repeat=have, seq=have)
        _, have = self._state()
        self.say(f"noise: defaults again ({have}/{self.repeats}): {objective} "
                 + (f"{m.value:.4g}" if m.value is not None else f"not measured ({m.reason})")
                 + (f"; spread so far {self._margin:.1%}" if self._margin is not None else ""))


def pick_confirmed(trials: list[Trial], objective: str, top: int) -> list[Trial]:
    """The ``top`` best complete searched trials (distinct configs) and every complete baseline
    (distinct configs), in that order."""
    direction = OBJECTIVES.get(objective, "maximize")
    complete = [t for t in trials if t.state == "complete" and _value(t, objective) is not None]
    feasible = [t for t in complete if (t.summary or {}).get("feasible", True)]
    searched = sorted((t for t in feasible if not t.is_baseline),
                      key=lambda t: _value(t, objective) or 0.0, reverse=direction == "maximize")
    out: list[Trial] = []
    seen: set[str] = set()
    for t in searched:
        if len([x for x in out if not x.is_baseline]) >= top:
            break
        if t.config_hash not in seen:
            out.append(t)
            seen.add(t.config_hash)
    for t in sorted((t for t in complete if t.is_baseline), key=lambda t: t.number or 0):
        if t.config_hash not in seen:
            out.append(t)
            seen.add(t.config_hash)
    return out


def confirm(measurer: Measurer, db: Engine, study_id: int, *, top: int, repeats: int,
            say: Say = log.info) -> int | None:
    """Re-measure the top searched configs and every baseline ``repeats`` times, interleaved; returns the
    session number (None when there is nothing to confirm)."""
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: must be >= 1")
    if top < 0:
        raise ValueError(f"--top {top}: must be >= 0")
    recorder = Recorder(db, study_id)
    with session_scope(db) as s:
        study = s.get(Study, study_id)
        assert study is not None
        objective = study.objectives[0]
        picks = pick_confirmed(list(s.scalars(select(Trial).where(Trial.study_id == study_id))), objective, top)
        session_no = max(1, next_session(s, study_id, "confirm"))
        direction = direction_of(study)
        n = noise(s, study)
        for t in picks:
            s.expunge(t)
    base_tol = measurer.settings.rel_tol
    tol = cap.noise_tolerance(n.rel_spread if n is not None else None, base_tol)
    if not picks:
        say("confirm: no complete trial to confirm")
        return None
    labels = [f"{t.number}" + (f" [{t.baseline_name}]" if t.baseline_name else "") for t in picks]
    say(f"confirm: {len(picks)} configs x {repeats} runs, interleaved ({direction} {objective}): "
        + " ".join(labels) + (" ..." if repeats > 1 else "")
        + (f"; each run bisected to {tol:.0%} (half the noise, {n.rel_spread:.0%})"
           if measurer.settings.capacity and n is not None and tol > base_tol else ""))
    seq = 0
    last: dict[int, float | None] = {t.id: _value(t, objective) for t in picks}
    # A config whose search met the target at no rate is re-run at the lowest rate that search tried.
    floor = {t.id: (t.summary or {}).get("capacity_hi_rps") for t in picks if _value(t, objective) == 0}
    for r in range(repeats):
        for t in round_order(picks, r):
            config = EngineConfig.from_dict(t.config, source=f"trial {t.number}")
            try:
                measurer.apply(config)
                m = measurer.measure(1.0, start_rps=last[t.id] or floor.get(t.id), first_step=cap.rerun_step(tol),
                                     floor_rps=floor.get(t.id), rel_tol=tol)
            except Exception as e:  # noqa: BLE001 - one failed run must not lose the session
                log.warning("confirm: trial %s run %d failed: %s", t.number, r + 1, e)
                measurer.apply(config, fresh=True)
                continue
            recorder.measurement(t.id, "confirm", m, session_no=session_no, repeat=r, seq=seq)
            seq += 1
            if m.value is not None:
                last[t.id] = m.value
            say(f"confirm: run {r + 1}/{repeats}, trial {labels[picks.index(t)]}: {objective} "
                + (f"{m.value:.4g}" if m.value is not None else f"not measured ({m.reason})"))
    return session_no


def settings_of(study: Study) -> dict[str, Any]:
    """The measuring settings a study stored (``mt_studies.settings``), or a one-line error."""
    if not study.settings:
        raise ValueError(f"study {study.name!r} has no measuring settings (made by an older moetune); "
                         "re-run it with `tuner run` to confirm it")
    return dict(study.settings)
