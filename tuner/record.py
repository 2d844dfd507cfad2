"""The tuner's writes to the results database (``db.store``), one short transaction each."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, select

from db.models import Trial
from db.session import session_scope
from db.store import (
    add_measurement,
    create_study,
    fail_trial,
    finish_trial,
    get_or_create_model,
    get_or_create_workload,
    stable_hash,
    start_trial,
)

if TYPE_CHECKING:
    from tuner.measure import Measurement

log = logging.getLogger(__name__)


def model_identity(backend: Any, model: str) -> dict[str, Any]:
    """The identity of a backend's model (``engine.backend.Backend``), as ``mt_models`` stores it."""
    identity = backend.model_identity()
    described = backend.describe()["model"]
    return {
        **identity,
        "path": str(described["path"]),
        "model": model,
        "n_params": backend.spec.total_params(),
        "shapes": {k: v for k, v in identity.items() if k != "fingerprint"},
        "checkpoint_dtype": described["dtype"],
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
    settings: Mapping[str, Any] | None = None,
    backend: str = "live",
) -> int:
    """Create (or find, when resuming) the ``mt_studies`` row; returns its id. ``backend``: the kind of
    the backend whose replays produce the study's results (``engine.backend.Backend.kind``)."""
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
            backend=backend,
            search_space_hash=space_hash,
            objectives=list(objectives),
            slo=slo,
            hardware=hardware,
            software=software,
            optuna_study_name=name,
            settings=settings,
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

    def finish(self, trial_id: int, result_dict: Mapping[str, Any], *, met: Mapping[str, bool]) -> None:
        """Store a complete trial (its best replay, whose summary carries the trial's figures) with its
        per-request SLO verdicts."""
        with session_scope(self.db) as s:
            finish_trial(s, trial_id, result_dict, "complete", met_slo_per_request=met)

    def fail(self, trial_id: int, error: str, state: str = "failed", summary: Mapping[str, Any] | None = None) -> None:
        """Mark a trial failed, infeasible or pruned, with why (and what it measured before it stopped)."""
        with session_scope(self.db) as s:
            fail_trial(s, trial_id, error, state=state, summary=summary)

    def measurement(self, trial_id: int, purpose: str, m: Measurement, *, session_no: int = 0, repeat: int = 0,
                    seq: int = 0) -> int:
        """Store one measurement of a trial's config with every replay it ran; returns its id."""
        with session_scope(self.db) as s:
            return add_measurement(
                s, self.study_id, trial_id, purpose=purpose, objective=m.objectives[0], value=m.value,
                fidelity=m.fidelity, n_requests=m.n_requests, runs_s=m.runs_s, overhead_s=m.overhead_s,
                probes=[r.row() for r in m.replays], session_no=session_no, repeat=repeat, seq=seq,
                upper_bound=m.upper_bound, bounded=m.capacity.bounded if m.capacity is not None else None,
                stopped_early=m.stopped_early, note=m.reason or None)

    def mark_lost(self, number: int, reason: str) -> None:
        """A trial whose worker died while it ran (its heartbeat stopped): failed, with why."""
        with session_scope(self.db) as s:
            trial = s.scalars(select(Trial).where(Trial.study_id == self.study_id,
                                                  Trial.number == number)).one_or_none()
            if trial is not None and trial.state == "running":
                fail_trial(s, trial.id, reason, state="failed")
