"""Fixtures of the tuner tests: a tiny model loaded once, a short workload, a study wired by hand.

Studies here replay at most 6 requests of ``builtin:tiny`` on ``builtin:qwen3_moe-tiny``, so a
trial takes about a second on a shared 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from db.session import make_engine, session_scope, upgrade
from engine.backend import as_backend
from engine.config import EngineConfig
from engine.hwinfo import hardware, software
from tuner.measure import Measurer, MeasureSettings
from tuner.metrics import latency_constraints
from tuner.objective import Objective
from tuner.record import Recorder, model_identity, record_study
from tuner.slo import SloSpec, parse_slo, study_constraints
from tuner.space import SearchSpace, build_space
from tuner.study import RetryLostTrial, make_pruner, open_storage, open_study

MODEL = "builtin:qwen3_moe-tiny"
WORKLOAD = "builtin:tiny"
REPO = Path(__file__).resolve().parents[2]
#: A short replay: 6 requests, all at once.
FAST = ["--model", MODEL, "--workload", WORKLOAD, "--mode", "offline", "--max-requests", "6"]


def count(db: Engine, model: Any, **where: Any) -> int:
    q = select(func.count()).select_from(model)
    for k, v in where.items():
        q = q.where(getattr(model, k) == v)
    with session_scope(db) as s:
        return s.scalar(q)


@dataclass
class Wired:
    """A study put together the way ``tuner run`` does, for tests that drive trials directly."""

    study: Any
    objective: Objective
    db: Engine
    study_id: int
    name: str


def run_cli(args: list[str], cwd: Path, timeout_s: float = 240, **popen: Any) -> subprocess.CompletedProcess:
    """``python -m tuner.cli ARGS`` in ``cwd`` with one PyTorch thread."""
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout_s, **popen)


def cli_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("MOETUNE_DB", None)
    return env


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers above, for test modules (``--import-mode=importlib`` cannot import this file)."""
    return SimpleNamespace(MODEL=MODEL, WORKLOAD=WORKLOAD, FAST=FAST, REPO=REPO, count=count, run_cli=run_cli,
                           cli_env=cli_env, last_json=last_json)


@pytest.fixture(scope="session")
def tiny_engine():
    """The tiny model, loaded once for the session (tests reconfigure it freely)."""
    from engine.runtime import Engine

    return Engine(MODEL)


@pytest.fixture(scope="session")
def tiny_workload():
    from workloads.schema import load_workload

    return load_workload(WORKLOAD)


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'moetune.db'}"


@pytest.fixture
def wire(tiny_engine, tiny_workload) -> Callable[..., Wired]:
    """``wire(url, slo=[...], space=None, mode="offline", max_requests=6, objectives=None, rungs=(1.0,),
    workload=None)`` -> :class:`Wired`: a study put together the way ``tuner run`` does."""
    made: list[Engine] = []

    def make(url: str, slo: list[str] | SloSpec = (), space: SearchSpace | None = None, mode: str = "offline",
             max_requests: int | None = 6, name: str = "wired", objectives: list[str] | None = None,
             rungs: tuple[float, ...] = (1.0,), workload: Any = None) -> Wired:
        slo_spec = slo if isinstance(slo, SloSpec) else parse_slo(list(slo))
        space = space or build_space(hardware())
        workload = workload or tiny_workload
        objectives = objectives or ["goodput_rps"]
        constraints = study_constraints(slo_spec, capacity=objectives[0] == "capacity_rps",
                                        latency=latency_constraints(objectives, mode))
        upgrade(url)
        db = make_engine(url)
        made.append(db)
        full = f"{name}-{space.space_hash()}"
        settings = MeasureSettings(tuple(objectives), mode, 1.0, max_requests, tuple(constraints))
        study_id = record_study(db, full, identity=model_identity(as_backend(tiny_engine), MODEL), workload=workload,
                                workload_spec=str(getattr(workload, "source", WORKLOAD)), slo=slo_spec.to_dict(),
                                objectives=objectives, space_hash=space.space_hash(), hardware=hardware(),
                                software=software(), settings={**settings.to_dict(), "model": MODEL})
        recorder = Recorder(db, study_id)
        on_lost = RetryLostTrial()
        on_lost.recorder = recorder
        study = open_study(open_storage(url, 10, on_lost), full, objectives, constraints, {"test": True},
                           pruner=make_pruner(len(rungs)))
        measurer = Measurer(tiny_engine, workload, slo_spec, settings)
        objective = Objective(measurer=measurer, model=MODEL, space=space, base=EngineConfig(), slo=slo_spec,
                              objectives=objectives, recorder=recorder, constraints=constraints, rungs=rungs)
        return Wired(study, objective, db, study_id, full)

    yield make
    for db in made:
        db.dispose()
