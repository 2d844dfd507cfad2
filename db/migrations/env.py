"""Alembic environment for moetune's tables.

Run programmatically by :func:`db.session.upgrade` (which hands over a connection in
``config.attributes["connection"]``), or from the command line for development::

    alembic -c db/alembic.ini revision --autogenerate -m "what changed"   # uses $MOETUNE_DB

Our version table is ``mt_alembic_version``; Optuna's storage keeps ``alembic_version`` in the
same database, and its tables are invisible to autogenerate (``include_name``/``include_object``).
"""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Connection

from db.models import Base
from db.session import (
    VERSION_TABLE,
    include_name,
    include_object,
    make_engine,
    migration_connection,
    resolve_url,
)

config = context.config
if config.config_file_name is not None:  # command-line use only
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _options() -> dict[str, Any]:
    return {
        "target_metadata": Base.metadata,
        "version_table": VERSION_TABLE,
        "include_name": include_name,
        "include_object": include_object,
        "compare_type": True,
        # Batch mode is what lets SQLite alter tables; on PostgreSQL batch operations are plain
        # ALTERs, so one rendered migration serves both.
        "render_as_batch": True,
    }


def _url() -> str:
    given = config.get_main_option("sqlalchemy.url") or context.get_x_argument(as_dictionary=True).get("url")
    return resolve_url(given)


def run_migrations_offline() -> None:
    context.configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"}, **_options())
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    # Our SQLite engines let SQLAlchemy emit BEGIN, so DDL there is transactional too.
    context.configure(connection=connection, transactional_ddl=True, **_options())
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with migration_connection(engine) as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
