"""Initial schema: models, workloads, studies, trials and per-trial records.

Every table is prefixed ``mt_``: Optuna's RDB storage shares the database.

Revision ID: 0001
Revises:
Create Date: 2026-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "mt_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("arch", sa.String(length=128), nullable=True),
        sa.Column("n_params", sa.BigInteger(), nullable=True),
        sa.Column("shapes", sa.JSON(), nullable=True),
        sa.Column("identity", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_models")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_mt_models_fingerprint")),
    )
    op.create_table(
        "mt_workloads",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("n_requests", sa.Integer(), nullable=True),
        sa.Column("duration_s", sa.Double(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_workloads")),
        sa.UniqueConstraint("fingerprint", name=op.f("uq_mt_workloads_fingerprint")),
    )
    op.create_table(
        "mt_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("optuna_study_name", sa.String(length=512), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("workload_id", sa.Integer(), nullable=False),
        sa.Column("hardware", sa.JSON(), nullable=False),
        sa.Column("hardware_hash", sa.String(length=64), nullable=False),
        sa.Column("software", sa.JSON(), nullable=False),
        sa.Column("slo", sa.JSON(), nullable=False),
        sa.Column("objectives", sa.JSON(), nullable=False),
        sa.Column("backend", sa.String(length=16), nullable=False),
        sa.Column("search_space_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("backend IN ('live', 'sim')", name=op.f("ck_mt_studies_backend")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["mt_models.id"], name=op.f("fk_mt_studies_model_id_mt_models"), ondelete="RESTRICT"
        ),
        sa.ForeignKeyConstraint(
            ["workload_id"],
            ["mt_workloads.id"],
            name=op.f("fk_mt_studies_workload_id_mt_workloads"),
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_studies")),
        sa.UniqueConstraint("name", name=op.f("uq_mt_studies_name")),
    )
    op.create_index(op.f("ix_mt_studies_model_id"), "mt_studies", ["model_id"], unique=False)
    op.create_index(op.f("ix_mt_studies_workload_id"), "mt_studies", ["workload_id"], unique=False)

    op.create_table(
        "mt_trials",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("is_baseline", sa.Boolean(), nullable=False),
        sa.Column("baseline_name", sa.String(length=128), nullable=True),
        sa.Column("output_tokens_per_s", sa.Double(), nullable=True),
        sa.Column("requests_per_s", sa.Double(), nullable=True),
        sa.Column("goodput_rps", sa.Double(), nullable=True),
        sa.Column("slo_attainment", sa.Double(), nullable=True),
        sa.Column("ttft_p50_ms", sa.Double(), nullable=True),
        sa.Column("ttft_p90_ms", sa.Double(), nullable=True),
        sa.Column("ttft_p99_ms", sa.Double(), nullable=True),
        sa.Column("tpot_p50_ms", sa.Double(), nullable=True),
        sa.Column("tpot_p90_ms", sa.Double(), nullable=True),
        sa.Column("tpot_p99_ms", sa.Double(), nullable=True),
        sa.Column("e2e_p50_ms", sa.Double(), nullable=True),
        sa.Column("e2e_p90_ms", sa.Double(), nullable=True),
        sa.Column("e2e_p99_ms", sa.Double(), nullable=True),
        sa.Column("itl_p50_ms", sa.Double(), nullable=True),
        sa.Column("itl_p90_ms", sa.Double(), nullable=True),
        sa.Column("itl_p99_ms", sa.Double(), nullable=True),
        sa.Column("quality_top1_agreement", sa.Double(), nullable=True),
        sa.Column("quality_mean_kl", sa.Double(), nullable=True),
        sa.Column("peak_rss_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_device_mem_bytes", sa.BigInteger(), nullable=True),
        sa.Column("duration_s", sa.Double(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "state IN ('running', 'complete', 'failed', 'infeasible', 'pruned')",
            name=op.f("ck_mt_trials_state"),
        ),
        sa.ForeignKeyConstraint(
            ["study_id"], ["mt_studies.id"], name=op.f("fk_mt_trials_study_id_mt_studies"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_trials")),
        sa.UniqueConstraint("study_id", "number", name=op.f("uq_mt_trials_study_id_number")),
    )
    op.create_index(op.f("ix_mt_trials_config_hash"), "mt_trials", ["config_hash"], unique=False)
    op.create_index(op.f("ix_mt_trials_study_id_state"), "mt_trials", ["study_id", "state"], unique=False)

    op.create_table(
        "mt_expert_stats",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("expert", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("resident", sa.Boolean(), nullable=False),
        sa.Column("precision", sa.String(length=32), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["mt_trials.id"],
            name=op.f("fk_mt_expert_stats_trial_id_mt_trials"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_expert_stats")),
    )
    op.create_index(
        op.f("ix_mt_expert_stats_trial_id_layer_expert"),
        "mt_expert_stats",
        ["trial_id", "layer", "expert"],
        unique=False,
    )

    op.create_table(
        "mt_requests",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=255), nullable=False),
        sa.Column("tag", sa.String(length=255), nullable=True),
        sa.Column("arrival_s", sa.Double(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("tpot_ms", sa.Double(), nullable=True),
        sa.Column("e2e_ms", sa.Double(), nullable=True),
        sa.Column("first_token_s", sa.Double(), nullable=True),
        sa.Column("finish_s", sa.Double(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=False),
        sa.Column("met_slo", sa.Boolean(), nullable=True),
        sa.Column("itl_ms", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["mt_trials.id"], name=op.f("fk_mt_requests_trial_id_mt_trials"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_requests")),
    )
    op.create_index(op.f("ix_mt_requests_trial_id"), "mt_requests", ["trial_id"], unique=False)

    op.create_table(
        "mt_steps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("start_s", sa.Double(), nullable=False),
        sa.Column("duration_ms", sa.Double(), nullable=False),
        sa.Column("batch_seqs", sa.Integer(), nullable=False),
        sa.Column("prefill_tokens", sa.Integer(), nullable=False),
        sa.Column("decode_tokens", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["mt_trials.id"], name=op.f("fk_mt_steps_trial_id_mt_trials"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_steps")),
    )
    op.create_index(op.f("ix_mt_steps_trial_id_step"), "mt_steps", ["trial_id", "step"], unique=False)

    op.create_table(
        "mt_telemetry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("trial_id", sa.Integer(), nullable=False),
        sa.Column("t_s", sa.Double(), nullable=False),
        sa.Column("cpu_percent", sa.Double(), nullable=False),
        sa.Column("rss_bytes", sa.BigInteger(), nullable=False),
        sa.Column("gpu_util_percent", sa.Double(), nullable=True),
        sa.Column("gpu_mem_bytes", sa.BigInteger(), nullable=True),
        sa.Column("gpu_power_w", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(
            ["trial_id"],
            ["mt_trials.id"],
            name=op.f("fk_mt_telemetry_trial_id_mt_trials"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_mt_telemetry")),
    )
    op.create_index(op.f("ix_mt_telemetry_trial_id_t_s"), "mt_telemetry", ["trial_id", "t_s"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_mt_telemetry_trial_id_t_s"), table_name="mt_telemetry")

    op.drop_table("mt_telemetry")
    op.drop_index(op.f("ix_mt_steps_trial_id_step"), table_name="mt_steps")

    op.drop_table("mt_steps")
    op.drop_index(op.f("ix_mt_requests_trial_id"), table_name="mt_requests")

    op.drop_table("mt_requests")
    op.drop_index(op.f("ix_mt_expert_stats_trial_id_layer_expert"), table_name="mt_expert_stats")

    op.drop_table("mt_expert_stats")
    op.drop_index(op.f("ix_mt_trials_study_id_state"), table_name="mt_trials")
    op.drop_index(op.f("ix_mt_trials_config_hash"), table_name="mt_trials")

    op.drop_table("mt_trials")
    op.drop_index(op.f("ix_mt_studies_workload_id"), table_name="mt_studies")
    op.drop_index(op.f("ix_mt_studies_model_id"), table_name="mt_studies")

    op.drop_table("mt_studies")
    op.drop_table("mt_workloads")
    op.drop_table("mt_models")
