"""Fixtures for the results-database tests: a SQLite file and a private PostgreSQL server."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from db.session import make_engine, upgrade
from db.testing import create_database
from engine.results import ExpertStat, RequestResult, RunResult, StepRecord, TelemetrySample


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """An empty database: a SQLite file, or a fresh database on the test PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'moetune.db'}"
    return create_database(request.getfixturevalue("pg_server"))


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'moetune.db'}"


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """An engine on a migrated, empty database (both backends)."""
    upgrade(db_url)
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


def make_run_result(
    n_requests: int = 6,
    n_steps: int = 10,
    layers: int = 2,
    experts: int = 4,
    itl_per_request: int = 3,
    seed: int = 0,
) -> RunResult:
    """A RunResult with every kind of record, a rejected request and a one-token request."""
    rng = random.Random(seed)
    requests = []
    for i in range(n_requests):
        arrival = i * 0.05
        if i == 1:
            requests.append(RequestResult(f"r{i}", arrival, 7, 0, None, None, [], "rejected", tag="chat"))
            continue
        out = 1 if i == 2 else itl_per_request + 1
        first = arrival + 0.01 + rng.random() * 0.02
        itl = [round(5 + rng.random() * 3, 6) for _ in range(out - 1)]
        finish = first + sum(itl) / 1e3
        requests.append(RequestResult(f"r{i}", arrival, 16 + i, out, first, finish, itl, "length"))
    steps = [
        StepRecord(s, s * 0.01, 4.5 + s % 3, 1 + s % 4, 16 if s == 0 else 0, s % 4) for s in range(n_steps)
    ]
    telemetry = [
        TelemetrySample(0.0, 50.0, 1_000_000),
        TelemetrySample(
            0.5, 75.5, 3_000_000_000, gpu_util_percent=40.0, gpu_mem_bytes=6_000_000_000, gpu_power_w=120.5
        ),
    ]
    stats = [
        ExpertStat(
            layer,
            e,
            rng.randrange(0, 1000),
            resident=e % 2 == 0,
            precision="int8" if e % 2 else "bf16",
            replicas=e // 3,
        )
        for layer in range(layers)
        for e in range(experts)
    ]
    return RunResult(
        meta={
            "model": {"arch": "tiny-moe"},
            "config_hash": "abc123",
            "hardware": {"cpu": "test", "gpus": []},
        },
        requests=requests,
        steps=steps,
        telemetry=telemetry,
        expert_stats=stats,
        duration_s=1.25,
        peak_rss_bytes=3_000_000_000,
        peak_device_mem_bytes=None,
        quality={"top1_agreement": 0.97, "mean_kl": 0.0125},
    )


@pytest.fixture
def run_result_factory():
    """:func:`make_run_result`, for tests that need RunResults of their own shape."""
    return make_run_result
