"""Validations: a simulated study's best trials re-run live, predicted against measured.

Adds ``mt_validations`` (one ``tuner validate`` run: the profile, this machine, whether it was forced,
the error summary) and ``mt_validation_metrics`` (per trial and metric: predicted, measured, each run).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "mt_validations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("session", sa.Integer(), nullable=False),
        sa.Column("top", sa.Integer(), nullable=False),
        sa.Column("repeats", sa.Integer(), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("mismatch", sa.Text(), nullable=True),
        sa.Column("profile", sa.JSON(), nullable=True),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("software", sa.JSON(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["study_id"], ["mt_studies.id"], name=op.f("fk_mt_validations_study_id_mt_studies"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_validations")),
        sa.UniqueConstraint("study_id", "session", name=op.f("uq_mt_validations_study_id_session")),
    )
    op.create_table(
        "mt_validation_metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("validation_id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("predicted", sa.Double(), nullable=True),
        sa.Column("measured", sa.Double(), nullable=True),
        sa.Column("runs", sa.JSON(), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["validation_id"],
            ["mt_validations.id"],
            name=op.f("fk_mt_validation_metrics_validation_id_mt_validations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["mt_trials.id"], name=op.f("fk_mt_validation_metrics_trial_id_mt_trials"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_validation_metrics")),
        sa.UniqueConstraint(
            "validation_id", "trial_id", "metric", name=op.f("uq_mt_validation_metrics_validation_id_trial_id_metric")
        ),
    )
    op.create_index(op.f("ix_mt_validation_metrics_trial_id"), "mt_validation_metrics", ["trial_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_mt_validation_metrics_trial_id"), table_name="mt_validation_metrics")
    op.drop_table("mt_validation_metrics")
    op.drop_table("mt_validations")
