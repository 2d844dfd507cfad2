"""Measurements and probes: capacity searches, noise repeats and confirmation runs.

Adds ``mt_measurements`` (every measurement of a trial's config, with its purpose, order and value)
and ``mt_probes`` (every replay of a measurement), the study's measuring ``settings``, and per-trial
``capacity_rps``, ``fidelity``, ``measured_s`` and ``overhead_s``.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TRIAL_COLUMNS = ("capacity_rps", "fidelity", "measured_s", "overhead_s")


def upgrade() -> None:
    with op.batch_alter_table("mt_studies") as batch:
        batch.add_column(sa.Column("settings", sa.JSON(), nullable=True))
    with op.batch_alter_table("mt_trials") as batch:
        for name in _TRIAL_COLUMNS:
            batch.add_column(sa.Column(name, sa.Double(), nullable=True))

    op.create_table(
        "mt_measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("purpose", sa.String(length=16), nullable=False),
        sa.Column("session", sa.Integer(), nullable=False),
        sa.Column("repeat", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("objective", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Double(), nullable=True),
        sa.Column("upper_bound", sa.Double(), nullable=True),
        sa.Column("fidelity", sa.Double(), nullable=False),
        sa.Column("n_requests", sa.Integer(), nullable=False),
        sa.Column("bounded", sa.Boolean(), nullable=True),
        sa.Column("stopped_early", sa.Boolean(), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("runs_s", sa.Double(), nullable=False),
        sa.Column("overhead_s", sa.Double(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("purpose IN ('search', 'noise', 'confirm')", name=op.f("ck_mt_measurements_purpose")),
        sa.ForeignKeyConstraint(
            ["study_id"], ["mt_studies.id"], name=op.f("fk_mt_measurements_study_id_mt_studies"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["mt_trials.id"], name=op.f("fk_mt_measurements_trial_id_mt_trials"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_measurements")),
    )
    op.create_index(op.f("ix_mt_measurements_trial_id"), "mt_measurements", ["trial_id"], unique=False)
    op.create_index(
        op.f("ix_mt_measurements_study_id_purpose_session"),
        "mt_measurements",
        ["study_id", "purpose", "session"],
        unique=False,
    )

    op.create_table(
        "mt_probes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("measurement_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("rate_scale", sa.Double(), nullable=False),
        sa.Column("rate_rps", sa.Double(), nullable=True),
        sa.Column("attainment", sa.Double(), nullable=False),
        sa.Column("met", sa.Boolean(), nullable=False),
        sa.Column("stopped", sa.Boolean(), nullable=False),
        sa.Column("n_requests", sa.Integer(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("goodput_rps", sa.Double(), nullable=True),
        sa.Column("ttft_p99_ms", sa.Double(), nullable=True),
        sa.Column("tpot_p99_ms", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["measurement_id"],
            ["mt_measurements.id"],
            name=op.f("fk_mt_probes_measurement_id_mt_measurements"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_probes")),
    )
    op.create_index(op.f("ix_mt_probes_measurement_id"), "mt_probes", ["measurement_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_mt_probes_measurement_id"), table_name="mt_probes")
    op.drop_table("mt_probes")
    op.drop_index(op.f("ix_mt_measurements_study_id_purpose_session"), table_name="mt_measurements")
    op.drop_index(op.f("ix_mt_measurements_trial_id"), table_name="mt_measurements")
    op.drop_table("mt_measurements")
    with op.batch_alter_table("mt_trials") as batch:
        for name in reversed(_TRIAL_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("mt_studies") as batch:
        batch.drop_column("settings")
