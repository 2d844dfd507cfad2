"""Expert-parallel figures in the result tables: per trial and per step.

Adds to ``mt_trials`` the run's ranks, its expert load imbalance (max/mean routed pairs per rank: the mean
over MoE layers and the worst layer) and the bytes dispatched and combined per step (mean); and to
``mt_steps`` each step's bytes dispatched and combined and its imbalance. NULL for one-rank runs and for
rows stored before this revision (their ``meta`` JSON keeps ``meta["ep"]``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TRIAL_COLUMNS = (("ep_ranks", sa.Integer()), ("ep_imbalance_mean", sa.Double()), ("ep_imbalance_max", sa.Double()),
                  ("ep_bytes_dispatched_per_step", sa.Double()), ("ep_bytes_combined_per_step", sa.Double()))
_STEP_COLUMNS = (("ep_bytes_dispatched", sa.BigInteger()), ("ep_bytes_combined", sa.BigInteger()),
                 ("ep_imbalance", sa.Double()))


def upgrade() -> None:
    with op.batch_alter_table("mt_trials") as batch:
        for name, kind in _TRIAL_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))
    with op.batch_alter_table("mt_steps") as batch:
        for name, kind in _STEP_COLUMNS:
            batch.add_column(sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("mt_steps") as batch:
        for name, _ in reversed(_STEP_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("mt_trials") as batch:
        for name, _ in reversed(_TRIAL_COLUMNS):
            batch.drop_column(name)
