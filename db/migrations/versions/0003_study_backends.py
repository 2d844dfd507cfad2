"""Study backends: ``stub``, ``sim`` and ``http`` beside ``live``.

``mt_studies.backend`` says which path produced a study's results: the torch engine (``live``), the
stub or the simulator (no tensors), or a server measured over HTTP (``workloads replay --url``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NAME = "ck_mt_studies_backend"
_BEFORE = ("live", "sim")
_AFTER = ("live", "stub", "sim", "http")


def _check(values: tuple[str, ...]) -> str:
    return f"backend IN ({', '.join(repr(v) for v in values)})"


def _recreate(values: tuple[str, ...]) -> None:
    # SQLite rebuilds the table (batch mode); the old constraint is named, so it is dropped by name.
    with op.batch_alter_table("mt_studies") as batch:
        batch.drop_constraint(op.f(_NAME), type_="check")
        batch.create_check_constraint(op.f(_NAME), _check(values))


def upgrade() -> None:
    _recreate(_AFTER)


def downgrade() -> None:
    newer = ", ".join(repr(v) for v in _AFTER if v not in _BEFORE)
    n = op.get_bind().execute(sa.text(f"SELECT COUNT(*) FROM mt_studies WHERE backend IN ({newer})")).scalar()
    if n:
        raise RuntimeError(f"cannot downgrade below 0003: {n} studies have backend {newer}, which 0002 does not allow")
    _recreate(_BEFORE)
