"""Database URLs, engines, sessions and migrations.

The URL comes from the caller (``--db URL``), else ``$MOETUNE_DB``, else :data:`DEFAULT_URL`
(``moetune.db`` in the working directory). SQLite and PostgreSQL (psycopg) are supported.
Every failure to open a database is a one-line :class:`DatabaseError` naming the URL with its
password masked.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, func, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import Session

from db.models import TABLE_PREFIX

log = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///moetune.db"
#: The one environment variable this package reads (see :func:`env_url`).
ENV_VAR = "MOETUNE_DB"
#: Our Alembic version table; Optuna's storage keeps ``alembic_version`` in the same database.
VERSION_TABLE = "mt_alembic_version"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

SUPPORTED_BACKENDS = ("sqlite", "postgresql")
_CONNECT_TIMEOUT_S = 5
_SQLITE_BUSY_TIMEOUT_S = 30.0
# Key of the PostgreSQL advisory lock that serialises concurrent upgrades from several workers.
_MIGRATION_LOCK_KEY = 0x6D74_0001


class DatabaseError(ValueError):
    """A database that cannot be opened or used; the message is one line naming the masked URL."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# --------------------------------------------------------------------------------------- URLs


def env_url() -> str | None:
    """The URL in ``$MOETUNE_DB``, or None when unset or empty."""
    return os.environ.get(ENV_VAR) or None


def resolve_url(url: str | URL | None = None) -> str:
    """The URL to use: ``url`` if given, else ``$MOETUNE_DB``, else :data:`DEFAULT_URL`.

    A bare ``postgresql://`` URL gets the psycopg (v3) driver. The result is a plain string with
    the password intact, suitable for Optuna's ``RDBStorage`` as well as :func:`make_engine`.
    """
    if isinstance(url, URL):
        return _normalise(url).render_as_string(hide_password=False)
    raw = url or env_url() or DEFAULT_URL
    return _normalise(_parse(raw)).render_as_string(hide_password=False)


def mask_url(url: str | URL) -> str:
    """``url`` with its password replaced by ``***``; works on strings that do not parse."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return re.sub(r"(://[^/@:]*:)[^@/]*@", r"\1***@", str(url))


def _parse(raw: str) -> URL:
    try:
        return make_url(raw)
    except (ArgumentError, ValueError) as e:
        raise DatabaseError(
            f"not a database URL: {mask_url(raw)!r} (expected sqlite:///PATH or postgresql://USER@HOST/DB)"
        ) from e


def _normalise(url: URL) -> URL:
    if url.drivername == "postgresql":
        return url.set(drivername="postgresql+psycopg")
    return url


def _check_url(url: URL) -> None:
    masked = mask_url(url)
    try:
        dialect = url.get_dialect()
    except NoSuchModuleError as e:
        raise DatabaseError(
            f"unknown database driver {url.drivername!r} in {masked}; "
            "supported: sqlite:///PATH, postgresql://USER:PASSWORD@HOST/DB"
        ) from e
    if dialect.name not in SUPPORTED_BACKENDS:
        raise DatabaseError(
            f"unsupported database {dialect.name!r} in {masked}; supported: {', '.join(SUPPORTED_BACKENDS)}"
        )
    if dialect.name == "sqlite":
        path = _sqlite_path(url)
        if path is not None and not path.parent.is_dir():
            raise DatabaseError(f"directory {str(path.parent)!r} does not exist for database {masked}")


def _sqlite_path(url: URL) -> Path | None:
    """The file of a SQLite URL, or None for an in-memory database."""
    db = url.database or ""
    if db in ("", ":memory:") or url.query.get("mode") == "memory":
        return None
    if db.startswith("file:"):
        db = re.sub(r"^file:(//)?", "", db).split("?", 1)[0]
        if db in ("", ":memory:"):
            return None
    return Path(db).expanduser()


def _one_line_cause(e: BaseException) -> str:
    orig = getattr(e, "orig", None) or e
    lines = [ln.strip() for ln in str(orig).splitlines() if ln.strip()]
    return lines[0] if lines else type(orig).__name__


# ------------------------------------------------------------------------------------ engines


def _sqlite_listeners(engine: Engine, *, wal: bool, readonly: bool) -> None:
    # Writers take the write lock when their transaction begins: a deferred transaction that
    # read first and writes later fails at once (SQLITE_BUSY) if another connection, such as
    # Optuna's heartbeat thread, committed in between; an immediate one waits its turn.
    begin = "BEGIN" if readonly else "BEGIN IMMEDIATE"

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, decide where transactions begin: this makes SAVEPOINT
        # and transactional DDL work (SQLAlchemy's documented recipe for pysqlite).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        if wal:
            # WAL lets the dashboard read while a tuner writes.
            _set_wal(cur, timeout_s=_SQLITE_BUSY_TIMEOUT_S)
            cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql(begin)


def _set_wal(cur: Any, *, timeout_s: float) -> None:
    """Switch a SQLite file to WAL, retrying while another connection holds it.

    Two workers that open a new file together both convert it, and one of them can get
    "database is locked" at once: it holds a read lock and wants the write lock the other holds,
    so SQLite refuses without calling the busy handler (the wait would deadlock). The conversion
    is persistent and idempotent, so waiting for the other to finish and trying again is safe.
    """
    deadline = time.monotonic() + timeout_s
    delay_s = 0.005
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() + delay_s > deadline:
                raise
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.1)


def _build_engine(url: URL, *, readonly: bool, echo: bool) -> Engine:
    masked = mask_url(url)
    backend = url.get_dialect().name
    kwargs: dict[str, Any] = {"echo": echo}
    if backend == "sqlite":
        kwargs["connect_args"] = {"timeout": _SQLITE_BUSY_TIMEOUT_S}
    else:
        connect_args: dict[str, Any] = {}
        if "connect_timeout" not in url.query:
            connect_args["connect_timeout"] = _CONNECT_TIMEOUT_S
        if readonly:
            connect_args["options"] = "-c default_transaction_read_only=on"
        kwargs.update(connect_args=connect_args, pool_pre_ping=True)
    try:
        engine = create_engine(url, **kwargs)
    except ImportError as e:
        raise DatabaseError(
            f"the database driver for {masked} is not installed ({e}); "
            "for PostgreSQL use postgresql+psycopg:// (pip install 'moetune[postgres]')"
        ) from e
    except (ArgumentError, TypeError) as e:
        raise DatabaseError(f"bad database URL {masked}: {_one_line_cause(e)}") from e
    if backend == "sqlite":
        _sqlite_listeners(engine, wal=not readonly and _sqlite_path(url) is not None, readonly=readonly)
    try:
        with engine.connect():
            pass
    except DBAPIError as e:
        engine.dispose()
        cause = _one_line_cause(e)
        if url.password:
            cause = cause.replace(str(url.password), "***")
        raise DatabaseError(f"cannot open database {masked}: {cause}") from e
    return engine


def make_engine(url: str | URL | None = None, *, echo: bool = False) -> Engine:
    """An engine for ``url`` (see :func:`resolve_url`), checked by connecting once.

    SQLite gets foreign keys on and, for files, WAL journaling. Raises :class:`DatabaseError`
    (one line, password masked) for an unparseable URL, an unknown driver, a SQLite file in a
    missing directory, or a server that cannot be reached.
    """
    parsed = _normalise(_parse(resolve_url(url)))
    _check_url(parsed)
    return _build_engine(parsed, readonly=False, echo=echo)


def make_readonly_engine(url: str | URL | None = None, *, echo: bool = False) -> Engine:
    """A read-only engine for the dashboard: it never creates, migrates or writes.

    SQLite opens the existing file with ``mode=ro``; PostgreSQL sessions run with
    ``default_transaction_read_only``. Raises :class:`DatabaseError` when the database is missing.
    """
    parsed = _normalise(_parse(resolve_url(url)))
    _check_url(parsed)
    if parsed.get_dialect().name == "sqlite":
        path = _sqlite_path(parsed)
        if path is None:
            raise DatabaseError(f"an in-memory database cannot be opened read-only: {mask_url(parsed)}")
        if not path.is_file():
            raise DatabaseError(f"no database file at {str(path)!r} ({mask_url(parsed)})")
        uri = path.resolve().as_uri()  # percent-encodes '?', '#' and spaces in the path
        parsed = URL.create("sqlite", database=uri, query={"mode": "ro", "uri": "true"})
    return _build_engine(parsed, readonly=True, echo=echo)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on an exception."""
    with Session(engine) as session, session.begin():
        yield session


# --------------------------------------------------------------------------------- migrations


def include_name(name: str | None, type_: str, parent_names: dict[str, Any]) -> bool:
    """Alembic filter: reflect only our ``mt_`` tables (Optuna's tables share the database)."""
    if type_ == "table":
        return name is not None and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE
    return True


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Alembic filter: compare and generate only objects that belong to ``mt_`` tables."""
    if type_ == "table":
        return name is not None and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE
    table = getattr(obj, "table", None)
    return table is None or table.name.startswith(TABLE_PREFIX)


def alembic_config(url: str | URL | None = None) -> Any:
    """An Alembic ``Config`` for our migrations, built in code (no ``alembic.ini`` needed)."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", resolve_url(url).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest migration this code ships."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at, or None when it has none of our tables."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


@contextmanager
def migration_connection(engine: Engine) -> Iterator[Connection]:
    """A connection in one transaction for running migrations.

    PostgreSQL: an advisory lock serialises workers that upgrade at the same time.
    SQLite: foreign keys are switched off while batch mode copies tables (a ``DROP TABLE`` with
    them on would cascade-delete child rows), then checked before commit.
    """
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        raw = conn.connection.driver_connection if sqlite else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys=OFF")  # outside any transaction, or SQLite ignores it
        try:
            with conn.begin():
                if conn.dialect.name == "postgresql":
                    conn.execute(select(func.pg_advisory_xact_lock(_MIGRATION_LOCK_KEY)))
                yield conn
                if sqlite:
                    bad = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
                    if bad:
                        raise DatabaseError(f"migration left rows with broken foreign keys: {bad[:3]}")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys=ON")


def upgrade(url_or_engine: str | URL | Engine | None = None) -> str:
    """Migrate the database to the newest schema; returns the revision it is at.

    Idempotent, and safe in a database where Optuna's tables already exist (we keep our own
    version table). ``None`` means :func:`resolve_url`'s choice.
    """
    from alembic import command
    from alembic.util import CommandError

    own = not isinstance(url_or_engine, Engine)
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
    masked = mask_url(engine.url)
    try:
        cfg = alembic_config()
        with migration_connection(engine) as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        rev = current_revision(engine)
    except CommandError as e:
        raise DatabaseError(
            f"cannot migrate {masked}: {_one_line_cause(e)} (was it created by a newer moetune?)"
        ) from e
    except DatabaseError:
        raise
    except SQLAlchemyError as e:
        raise DatabaseError(f"cannot migrate {masked}: {_one_line_cause(e)}") from e
    finally:
        if own:
            engine.dispose()
    log.info("database %s at schema revision %s", masked, rev)
    return rev or ""
