"""Optuna studies stored in the results database: open or resume, seed baselines, run trials.

Optuna's RDB storage uses the same database as ``db/`` (its tables beside our ``mt_`` ones), so
``optuna-dashboard URL`` opens it as is. Studies are resumable: re-running the same command loads
the study (``load_if_exists``) and runs until it holds the requested number of finished trials.
A trial left running by a killed worker stops sending heartbeats; once its grace period passes,
the next trial start fails it and enqueues a retry with the same parameters.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from db.session import DatabaseError, mask_url
from tuner.baselines import Baseline
from tuner.metrics import better, directions, pareto_ranks
from tuner.objective import (
    ATTR_BASELINE,
    ATTR_CONSTRAINTS,
    ATTR_INTERRUPTED,
    ATTR_STATE,
    NATIVE_CONSTRAINTS,
    TrialFailed,
    constraints_of,
)
from tuner.record import Recorder

log = logging.getLogger(__name__)

ATTR_SETTINGS = "moetune_settings"
DEFAULT_HEARTBEAT_S = 10
GRACE_HEARTBEATS = 3  # a trial is stale after this many missed heartbeats


class StudyError(ValueError):
    """A study that cannot be opened or resumed as asked; one line."""


# ------------------------------------------------------------------------------------- names


def default_study_name(model: str, workload: str) -> str:
    """``builtin:qwen3_moe-tiny`` + ``builtin:tiny`` -> ``qwen3_moe-tiny.tiny``."""

    def short(spec: str) -> str:
        spec = spec.removeprefix("builtin:").rstrip("/")
        return Path(spec).name or spec

    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{short(model)}.{short(workload)}")


def full_study_name(name: str, space_hash: str) -> str:
    """``<name>-<space hash>``: a changed search space starts another study."""
    return name if name.endswith(f"-{space_hash}") else f"{name}-{space_hash}"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|d|h|m|s)?", re.IGNORECASE)
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, None: 1.0}


def parse_duration(text: str) -> float:
    """``"8h"``, ``"90m"``, ``"1h30m"``, ``"45s"``, ``"2d"`` or plain seconds -> seconds."""
    t = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not t or pos != len(t) or total <= 0:
        raise ValueError(f"--timeout {text!r}: expected a duration such as 8h, 90m, 1h30m or 3600")
    return total


# ----------------------------------------------------------------------------------- storage


class RetryLostTrial:
    """Heartbeat-stale callback: retry the trial with the same parameters and mark our row failed."""

    def __init__(self) -> None:
        try:
            from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
        except ImportError:  # optuna < 4.9
            from optuna.storages import RetryFailedTrialCallback as Retry
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._retry = Retry(max_retry=3)
        self.recorder: Recorder | None = None

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        log.warning("trial %d of %s lost its worker (no heartbeat); retrying it", trial.number,
                    study.study_name)
        self._retry(study, trial)
        if self.recorder is not None:
            self.recorder.mark_lost(trial.number, "its worker stopped (no heartbeat); retried as a new trial")


def open_storage(url: str, heartbeat_s: int = DEFAULT_HEARTBEAT_S,
                 on_lost: RetryLostTrial | None = None) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on ``url`` (already migrated by ``db.session.upgrade``), with heartbeats."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 30}
    else:
        kwargs["pool_pre_ping"] = True
    try:
        import inspect

        # Optuna >= 4.9 renamed the callback; the old name warns.
        callback_arg = ("heartbeat_stale_trial_callback"
                        if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
                        else "failed_trial_callback")
        callback: dict[str, Any] = {callback_arg: on_lost or RetryLostTrial()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                url, engine_kwargs=kwargs, heartbeat_interval=heartbeat_s,
                grace_period=GRACE_HEARTBEATS * heartbeat_s, **callback)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy and Optuna raise many kinds
        cause = " ".join(str(e).split())[:200]
        raise DatabaseError(f"cannot open Optuna storage in {mask_url(url)}: {cause}") from e


def make_pruner(rungs: int) -> optuna.pruners.BasePruner:
    """Successive halving over the fidelity rungs (a trial reports rung ``i`` at step ``i + 1``): at each
    prefix a trial goes on only when its value is in the best half of the trials measured there."""
    if rungs < 2:
        return optuna.pruners.NopPruner()
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2, min_early_stopping_rate=0)


def open_study(storage: optuna.storages.RDBStorage, name: str, objectives: Sequence[str],
               constraint_names: Sequence[str], settings: Mapping[str, Any], seed: int = 0,
               pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """Create or resume the Optuna study ``name``.

    Raises :class:`StudyError` when a study of that name was started with other settings (model,
    workload, mode, SLO, objectives...). The TPE sampler is seeded with ``seed`` plus the number of
    trials already in the study, so a resumed run does not redraw the points it drew before.
    """
    settings = _jsonable(settings)
    existing = [s for s in storage.get_all_studies() if s.study_name == name]
    if existing:
        stored = existing[0].user_attrs.get(ATTR_SETTINGS)
        if stored is not None and stored != settings:
            diff = [k for k in sorted(set(stored) | set(settings)) if stored.get(k) != settings.get(k)]
            shown = ", ".join(f"{k}={stored.get(k)!r} (now {settings.get(k)!r})" for k in diff[:3])
            raise StudyError(f"study {name!r} was started with {shown}; use another --study name")
    dirs: list[Any] = directions(objectives)
    study = optuna.create_study(storage=storage, study_name=name, directions=dirs, load_if_exists=True,
                                pruner=pruner)
    if not existing:
        study.set_user_attr(ATTR_SETTINGS, settings)
    n_before = len(study.get_trials(deepcopy=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Multivariate TPE with groups models knobs jointly and copes with conditional knobs.
        study.sampler = optuna.samplers.TPESampler(
            seed=seed + n_before, multivariate=True, group=True,
            constraints_func=constraints_of(constraint_names) if constraint_names and not NATIVE_CONSTRAINTS else None,
        )
    return study


def _jsonable(obj: Any) -> Any:
    from db.store import json_safe

    return json_safe(obj)


def enqueue_baselines(study: optuna.Study, points: list[tuple[Baseline, dict[str, Any]]],
                      n_trials: int | None = None) -> list[str]:
    """Enqueue each baseline once per study (not again on resume); returns the names enqueued.

    With ``n_trials``, no more are enqueued than the study has room for; a later run with more
    trials enqueues the rest.
    """
    trials = study.get_trials(deepcopy=False)
    seen = {t.user_attrs.get(ATTR_BASELINE) for t in trials}
    room = None
    if n_trials is not None:
        # A trial left RUNNING by a killed worker will come back as a retry: keep its slot too.
        pending = sum(1 for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING))
        room = n_trials - len(counted_trials(trials)) - pending
    enqueued: list[str] = []
    for baseline, params in points:
        if baseline.name in seen:
            continue
        if room is not None and len(enqueued) >= room:
            break
        study.enqueue_trial(params, user_attrs={ATTR_BASELINE: baseline.name})
        enqueued.append(baseline.name)
    if enqueued:
        log.info("enqueued baselines %s", ", ".join(enqueued))
    return enqueued


# ----------------------------------------------------------------------------------- running


def counted_trials(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """Trials that count toward ``--trials``: finished, less those interrupted or lost and retried."""
    retried: set[int] = set()
    for t in trials:
        retried.update(t.system_attrs.get("retry_history") or [])

    def counts(t: FrozenTrial) -> bool:
        if t.state == TrialState.FAIL:
            return t.number not in retried and not t.user_attrs.get(ATTR_INTERRUPTED)
        return t.state in (TrialState.COMPLETE, TrialState.PRUNED)

    return [t for t in trials if counts(t)]


def feasible(t: FrozenTrial) -> bool:
    """A complete trial that met every constraint."""
    return t.state == TrialState.COMPLETE and all(
        v <= 0 for v in (t.user_attrs.get(ATTR_CONSTRAINTS) or {}).values())


def best_trials(trials: Sequence[FrozenTrial], objectives: Sequence[str]) -> list[FrozenTrial]:
    """Single objective: the best feasible trial (a list of one); several: the feasible Pareto front."""
    dirs = directions(objectives)
    ok = [t for t in trials if feasible(t) and t.values is not None]
    if not ok:
        return []
    if len(dirs) == 1:
        best = ok[0]
        for t in ok[1:]:
            if better(t.values[0], best.values[0], dirs[0]):
                best = t
        return [best]
    ranks = pareto_ranks([t.values for t in ok], dirs)
    return [t for t, r in zip(ok, ranks, strict=True) if r == 0]


def trial_state(t: FrozenTrial) -> str:
    """Our state of an Optuna trial: complete, infeasible, pruned, failed, running or waiting."""
    if t.state in (TrialState.RUNNING, TrialState.WAITING):
        return t.state.name.lower()
    return t.user_attrs.get(ATTR_STATE) or t.state.name.lower()


def run_trials(study: optuna.Study, objective: Callable[[optuna.Trial], Any], n_trials: int,
               timeout_s: float | None = None,
               on_trial: Callable[[optuna.Study, FrozenTrial, int], None] | None = None,
               between: Callable[[optuna.Study, FrozenTrial], None] | None = None) -> int:
    """Run trials until the study holds ``n_trials`` counted trials or ``timeout_s`` passes.

    Baselines and retries (waiting trials) run first. ``between(study, trial)`` runs after each trial
    (the noise repeats interleaved with the first baselines). A crashing trial is recorded and the
    study goes on; Ctrl-C stops after the current trial is recorded (``KeyboardInterrupt`` propagates).
    Returns the number of trials this call ran.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ran = 0

    def after(st: optuna.Study, frozen: FrozenTrial) -> None:
        if on_trial is not None:
            on_trial(st, frozen, len(counted_trials(st.get_trials(deepcopy=False))))
        if between is not None:
            between(st, frozen)

    while True:
        done = len(counted_trials(study.get_trials(deepcopy=False)))
        if done >= n_trials or (deadline is not None and time.monotonic() >= deadline):
            return ran
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), callbacks=[after], gc_after_trial=False)
        ran += 1
