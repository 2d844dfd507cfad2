"""Plans: ``engine plan`` runs and the configs they priced, for the dashboard's Plans page.

Adds ``mt_plans`` (one run: model, workload, SLO, profiles with their ``calibrated`` flag, software,
wall seconds) and ``mt_plan_configs`` (per priced config: profile, knob overrides, every printed figure,
the error where it could not be priced).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "mt_plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=512), nullable=False),
        sa.Column("workload", sa.String(length=256), nullable=False),
        sa.Column("workload_source", sa.String(length=1024), nullable=True),
        sa.Column("n_requests", sa.Integer(), nullable=False),
        sa.Column("slo", sa.JSON(), nullable=False),
        sa.Column("profiles", sa.JSON(), nullable=False),
        sa.Column("base_config", sa.JSON(), nullable=False),
        sa.Column("software", sa.JSON(), nullable=False),
        sa.Column("wall_s", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_plans")),
    )
    op.create_table(
        "mt_plan_configs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("plan_id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("profile", sa.String(length=128), nullable=False),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("budget_gib", sa.Double(), nullable=True),
        sa.Column("hi_precision", sa.String(length=16), nullable=False),
        sa.Column("missing_expert", sa.String(length=16), nullable=True),
        sa.Column("expert_batching", sa.String(length=16), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("offline_tokens_per_s", sa.Double(), nullable=True),
        sa.Column("ttft_p99_ms", sa.Double(), nullable=True),
        sa.Column("tpot_p99_ms", sa.Double(), nullable=True),
        sa.Column("capacity_rps", sa.Double(), nullable=True),
        sa.Column("capacity_bounded", sa.Boolean(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["plan_id"], ["mt_plans.id"], name=op.f("fk_mt_plan_configs_plan_id_mt_plans"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_plan_configs")),
        sa.UniqueConstraint("plan_id", "seq", name=op.f("uq_mt_plan_configs_plan_id_seq")),
    )


def downgrade() -> None:
    op.drop_table("mt_plan_configs")
    op.drop_table("mt_plans")
