"""The tuner's writes to the results database (``db.store``), one short transaction each."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine, select

from db.models import Trial
from db.session import session_scope
from db.store import (
    create_study,
    fail_trial,
    finish_trial,
    get_or_create_model,
    get_or_create_workload,
    stable_hash,
    start_trial,
)

log = logging.getLogger(__name__)


def model_identity(engine: Any, model: str) -> dict[str, Any]:
    """The identity of a loaded ``engine.runtime.Engine``'s model, as ``mt_models`` stores it."""
    spec = engine.spec
    identity = spec.identity(engine.fingerprint)
    return {
        **identity,
        "path": str(engine.model_path),
        "model": model,
        "n_params": spec.total_params(),
        "shapes": {k: v for k, v in identity.items() if k != "fingerprint"},
        "checkpoint_dtype": str(engine.ckpt.dtype).replace("torch.", ""),
    }


def workload_fingerprint(workload: Any) -> str:
    """A hash of a workload's name and requests (what a replay depends on)."""
    return stable_hash({"name": workload.name, "requests": [r.to_json() for r in workload.requests]})


def record_study(
    db: Engine,
    name: str,
    *,
    identity: Mapping[str, Any],
    workload: Any,
    workload_spec: str,
    slo: Mapping[str, Any],
    objectives: list[str],
    space_hash: str,
    hardware: Mapping[str, Any],
    software: Mapping[str, Any],
) -> int:
    """Create (or find, when resuming) the ``mt_studies`` row; returns its id."""
    with session_scope(db) as s:
        model_id = get_or_create_model(s, identity)
        workload_id = get_or_create_workload(
            s,
            workload.name,
            source=workload_spec,
            n_requests=len(workload.requests),
            duration_s=workload.duration_s,
            metadata=workload.metadata,
            fingerprint=workload_fingerprint(workload),
        )
        return create_study(
            s,
            name,
            model_id=model_id,
            workload_id=workload_id,
            backend="live",
            search_space_hash=space_hash,
            objectives=list(objectives),
            slo=slo,
            hardware=hardware,
            software=software,
            optuna_study_name=name,
        )


class Recorder:
    """Writes one study's trials: start, then finish or fail."""

    def __init__(self, db: Engine, study_id: int) -> None:
        self.db = db
        self.study_id = study_id

    def start(self, number: int, config: Mapping[str, Any], config_hash: str,
              baseline: str | None = None) -> int:
        """A running trial row; returns its id."""
        with session_scope(self.db) as s:
            return start_trial(s, self.study_id, number, config, config_hash,
                               is_baseline=baseline is not None, baseline_name=baseline)

    def finish(self, trial_id: int, result_dict: Mapping[str, Any], *, slo_attainment: float,
               goodput_rps: float, met: Mapping[str, bool]) -> None:
        """Store a complete run with its per-request SLO verdicts."""
        with session_scope(self.db) as s:
            finish_trial(s, trial_id, result_dict, "complete", slo_attainment=slo_attainment,
                         goodput_rps=goodput_rps, met_slo_per_request=met)

    def fail(self, trial_id: int, error: str, state: str = "failed") -> None:
        """Mark a trial failed, infeasible or pruned, with why."""
        with session_scope(self.db) as s:
            fail_trial(s, trial_id, error, state=state)

    def mark_lost(self, number: int, reason: str) -> None:
        """A trial whose worker died while it ran (its heartbeat stopped): failed, with why."""
        with session_scope(self.db) as s:
            trial = s.scalars(select(Trial).where(Trial.study_id == self.study_id,
                                                  Trial.number == number)).one_or_none()
            # Also a row already written complete: its worker died before Optuna recorded the result, and
            # the retry runs it again (the study counts the retry, so the row must not count too).
            if trial is not None and trial.state != "failed":
                fail_trial(s, trial.id, reason, state="failed")
