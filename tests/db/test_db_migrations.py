"""Migrations: they create every table, match the models, re-run safely and share with Optuna."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import column, inspect, select, table, update

from db.models import Base
from db.session import (
    VERSION_TABLE,
    DatabaseError,
    alembic_config,
    current_revision,
    head_revision,
    include_name,
    include_object,
    make_engine,
    migration_connection,
    upgrade,
)

REPO = Path(__file__).resolve().parents[2]
OUR_TABLES = set(Base.metadata.tables)


def _diff(engine) -> list:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "include_name": include_name,
                "include_object": include_object,
                "compare_type": True,
                "version_table": VERSION_TABLE,
            },
        )
        return compare_metadata(ctx, Base.metadata)


def _optuna_roundtrip(url: str, study_name: str) -> int:
    """Run a tiny Optuna study in RDB storage at ``url``; returns the trial count."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    try:
        study = optuna.create_study(study_name=study_name, storage=storage, load_if_exists=True)
        study.optimize(lambda t: (t.suggest_float("x", -1, 1) - 0.5) ** 2, n_trials=2)
        return len(study.trials)
    finally:
        storage.engine.dispose()


def test_upgrade_creates_every_table(db_url):
    assert upgrade(db_url) == head_revision()
    engine = make_engine(db_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert tables >= OUR_TABLES
        assert VERSION_TABLE in tables
        assert all(t.startswith("mt_") for t in OUR_TABLES)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_migrations_match_the_models(db_url):
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        assert _diff(engine) == []
    finally:
        engine.dispose()


def test_upgrade_is_idempotent_and_coexists_with_optuna(db_url):
    assert _optuna_roundtrip(db_url, "before") == 2  # Optuna first: its tables and alembic_version
    head = upgrade(db_url)
    assert upgrade(db_url) == head
    assert _optuna_roundtrip(db_url, "after") == 2  # Optuna still accepts its schema
    assert _optuna_roundtrip(db_url, "before") == 4  # and resumes the earlier study
    assert upgrade(db_url) == head

    engine = make_engine(db_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert {"studies", "trials", "alembic_version"} <= tables
        assert tables >= OUR_TABLES | {VERSION_TABLE}
        assert _diff(engine) == []  # Optuna's tables are invisible to the comparison
        with engine.connect() as conn:
            ours = conn.scalars(select(column("version_num")).select_from(table(VERSION_TABLE))).all()
            theirs = conn.scalars(select(column("version_num")).select_from(table("alembic_version"))).all()
        assert ours == [head]
        assert theirs and theirs != [head]
    finally:
        engine.dispose()


def test_downgrade_removes_only_our_tables(sqlite_url):
    _optuna_roundtrip(sqlite_url, "s")
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with migration_connection(engine) as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "base")
        tables = set(inspect(engine).get_table_names())
        assert not (OUR_TABLES & tables)
        assert {"studies", "trials"} <= tables
        assert current_revision(engine) is None
    finally:
        engine.dispose()
    assert upgrade(sqlite_url) == head_revision()
    assert _optuna_roundtrip(sqlite_url, "s") == 4


def test_alembic_command_line_uses_our_env(tmp_path):
    """``alembic -c db/alembic.ini`` (the developer path) upgrades and finds nothing to generate."""
    env = {**os.environ, "MOETUNE_DB": f"sqlite:///{tmp_path / 'cli.db'}", "PYTHONPATH": str(REPO)}
    alembic = [sys.executable, "-m", "alembic", "-c", str(REPO / "db" / "alembic.ini")]
    for args in (["upgrade", "head"], ["check"]):
        proc = subprocess.run(
            [*alembic, *args], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cli.db").exists()


def test_newer_database_is_a_one_line_error(sqlite_url):
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                update(table(VERSION_TABLE, column("version_num"))).values(version_num="9999_future")
            )
        with pytest.raises(DatabaseError) as e:
            upgrade(engine)
        assert "\n" not in str(e.value) and "newer moetune" in str(e.value)
    finally:
        engine.dispose()


def test_concurrent_upgrades_from_several_workers(db_url):
    """Workers starting together on a fresh database all end at head (lock, then no-op)."""
    code = "import sys; from db.session import upgrade; print(upgrade(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, db_url],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert {out.strip() for out, _ in outs} == {head_revision()}


def _study(engine, name: str, backend: str) -> int:
    from db.session import session_scope
    from db.store import create_study, get_or_create_model, get_or_create_workload

    with session_scope(engine) as s:
        model_id = get_or_create_model(s, {"fingerprint": "f" * 16, "path": "m", "arch": "qwen3_moe"})
        workload_id = get_or_create_workload(s, "w", source="builtin:w", n_requests=1, duration_s=1.0)
        return create_study(s, name, model_id=model_id, workload_id=workload_id, backend=backend,
                            search_space_hash="h", objectives=["capacity_rps"], slo={}, hardware={}, software={})


def _migrate(engine, how: str, revision: str) -> None:
    with migration_connection(engine) as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        getattr(command, how)(cfg, revision)


def test_study_backends_migration(db_url):
    """0003 lets a study say it came from the stub, the simulator or a server over HTTP; the database
    itself (not only the store) refuses any other value, and a 0002 study survives the upgrade."""
    from sqlalchemy.exc import IntegrityError

    from db.models import BACKENDS, Study

    assert BACKENDS == ("live", "stub", "sim", "http")
    engine = make_engine(db_url)
    try:
        _migrate(engine, "upgrade", "0002")
        old = _study(engine, "old", "live")
        with pytest.raises(IntegrityError), engine.begin() as conn:  # 0002's check: live or sim
            conn.execute(update(Study).where(Study.id == old).values(backend="http"))
        assert upgrade(db_url) == head_revision()
        ids = {b: _study(engine, f"s-{b}", b) for b in BACKENDS}
        with engine.connect() as conn:
            got = dict(conn.execute(select(Study.name, Study.backend)).all())
        assert got == {"old": "live", **{f"s-{b}": b for b in BACKENDS}}
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(update(Study).where(Study.id == ids["http"]).values(backend="bogus"))
        # Going back below 0003 would break the studies only it allows: refused, nothing changed.
        with pytest.raises(RuntimeError, match="cannot downgrade below 0003: 2 studies"):
            _migrate(engine, "downgrade", "0002")
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()
