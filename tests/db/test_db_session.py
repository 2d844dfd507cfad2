"""URLs, engines and sessions: one-line errors, SQLite pragmas, read-only access."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from db.models import Model
from db.session import (
    DEFAULT_URL,
    ENV_VAR,
    DatabaseError,
    make_engine,
    make_readonly_engine,
    mask_url,
    resolve_url,
    session_scope,
    upgrade,
)

MODEL_ROW = {"fingerprint": "fp", "path": "/m"}


def test_url_comes_from_argument_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_url() == DEFAULT_URL == "sqlite:///moetune.db"
    monkeypatch.setenv(ENV_VAR, "sqlite:////tmp/from-env.db")
    assert resolve_url() == "sqlite:////tmp/from-env.db"
    assert resolve_url("sqlite:///given.db") == "sqlite:///given.db"
    # a bare postgresql:// URL gets psycopg 3, the driver moetune installs; the password is kept
    assert resolve_url("postgresql://u:pw@h/db") == "postgresql+psycopg://u:pw@h/db"


def test_mask_url_hides_passwords_even_in_unparseable_urls():
    assert mask_url("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert "secret" not in mask_url("post gres://u:secret@h/db")


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "postgresql://u:secret@127.0.0.1:1/x",
            "cannot open database postgresql+psycopg://u:***@127.0.0.1:1/x",
        ),
        ("nosuchdriver://x", "unknown database driver 'nosuchdriver'"),
        ("sqlite:////nonexistent-dir/sub/moetune.db", "directory '/nonexistent-dir/sub' does not exist"),
        ("not a url at all", "not a database URL"),
        ("mysql://u:secret@h/db", "unsupported database 'mysql'"),
    ],
)
def test_bad_urls_are_one_line_errors(url, expected):
    for fn in (make_engine, upgrade, make_readonly_engine):
        with pytest.raises(DatabaseError) as e:
            fn(url)
        message = str(e.value)
        assert expected in message, message
        assert "\n" not in message and "secret" not in message
        assert isinstance(e.value, ValueError)


def test_bad_url_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "nosuchdriver://x")
    with pytest.raises(DatabaseError, match="nosuchdriver"):
        make_engine()


def test_sqlite_has_foreign_keys_and_wal(sqlite_url):
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()


def test_session_scope_commits_or_rolls_back(engine):
    with session_scope(engine) as s:
        s.execute(insert(Model), [MODEL_ROW])
    with pytest.raises(RuntimeError), session_scope(engine) as s:
        s.execute(insert(Model), [{**MODEL_ROW, "fingerprint": "fp2"}])
        raise RuntimeError("boom")
    with session_scope(engine) as s:
        assert s.scalars(select(Model.fingerprint)).all() == ["fp"]


def test_savepoints_work(engine):
    """Nested transactions (SAVEPOINT) work on both backends, SQLite included."""
    with session_scope(engine) as s:
        s.execute(insert(Model), [MODEL_ROW])
        with pytest.raises(IntegrityError), s.begin_nested():
            s.execute(insert(Model), [MODEL_ROW])  # duplicate fingerprint
        s.execute(insert(Model), [{**MODEL_ROW, "fingerprint": "fp3"}])
    with session_scope(engine) as s:
        assert sorted(s.scalars(select(Model.fingerprint))) == ["fp", "fp3"]


def test_readonly_engine_reads_but_never_writes(engine, db_url):
    with session_scope(engine) as s:
        s.execute(insert(Model), [MODEL_ROW])
    ro = make_readonly_engine(db_url)
    try:
        with ro.connect() as conn:
            assert conn.scalars(select(Model.fingerprint)).all() == ["fp"]
        with pytest.raises(DBAPIError, match="(?i)read-?only"), ro.begin() as conn:
            conn.execute(insert(Model), [{**MODEL_ROW, "fingerprint": "ro"}])
    finally:
        ro.dispose()


def test_readonly_engine_does_not_create_a_database(tmp_path):
    path = tmp_path / "missing.db"
    with pytest.raises(DatabaseError, match="no database file"):
        make_readonly_engine(f"sqlite:///{path}")
    assert not path.exists()


def test_readonly_engine_handles_awkward_paths(tmp_path):
    odd = tmp_path / "a dir #1 50%" / "my db.sqlite"
    odd.parent.mkdir()
    url = f"sqlite:///{odd}"
    upgrade(url)
    ro = make_readonly_engine(url)
    try:
        with ro.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar() == 1
            assert conn.scalars(select(Model.id)).all() == []
    finally:
        ro.dispose()
    assert [p.name for p in odd.parent.iterdir() if p.suffix == ".sqlite"] == ["my db.sqlite"]


def test_sqlite_writers_wait_for_each_other(sqlite_url):
    """A transaction that reads and then writes is not failed by a write committed meanwhile."""
    upgrade(sqlite_url)
    first, second = make_engine(sqlite_url), make_engine(sqlite_url)
    try:
        with session_scope(first) as s:
            assert s.scalars(select(Model.id)).all() == []  # reads first ...
            other = threading.Thread(target=_insert_model, args=(second, "other"))
            other.start()  # ... while another connection wants to write
            time.sleep(0.2)
            s.execute(insert(Model), [MODEL_ROW])  # ... then writes
        other.join(timeout=30)
        with session_scope(first) as s:
            assert sorted(s.scalars(select(Model.fingerprint))) == ["fp", "other"]
    finally:
        first.dispose()
        second.dispose()


def _insert_model(engine, fingerprint: str) -> None:
    with session_scope(engine) as s:
        s.execute(insert(Model), [{**MODEL_ROW, "fingerprint": fingerprint}])


def _open_at_barrier(url: str, barrier) -> None:
    barrier.wait(timeout=30)
    make_engine(url).dispose()


def test_workers_opening_a_new_sqlite_file_together_all_get_it(tmp_path):
    """Two workers that create the same file at once both convert it to WAL; without a retry one
    of them got "database is locked" in about one round in twenty (SQLite refuses the lock that
    would deadlock without waiting), so a hundred rounds almost surely catch it."""
    ctx = multiprocessing.get_context("fork")
    failed = []
    for i in range(100):
        url = f"sqlite:///{tmp_path / f'new-{i}.db'}"
        barrier = ctx.Barrier(2)
        procs = [ctx.Process(target=_open_at_barrier, args=(url, barrier)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        failed += [i for p in procs if p.exitcode != 0]
    assert failed == []
