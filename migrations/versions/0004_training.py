"""Training jobs, inference engines and weight versions (issue 6, docs/training.md).

``training_jobs`` holds one row per job identity; a partial unique index keeps at most one job
in flight per deployment. ``engines`` and ``weight_versions`` record which engine serves which
runtime load id and which versions were committed.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Spelled out, not imported: a revision must not change when the models do.
IN_FLIGHT = ("state IN ('RUNNING', 'AMBIGUOUS', 'CHECKPOINT', 'UPDATING_WEIGHTS', 'READY_TO_COMMIT', "
             "'HEAD_COMMITTED', 'REJECTING')")


def _entity_columns() -> list[sa.Column]:
    return [
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("updated_at", journal.types.UTCDateTime(), nullable=False),
    ]


def upgrade() -> None:
    json = journal.types.JSONValue
    op.create_table(
        "training_jobs",
        *_entity_columns(),
        sa.Column("deployment", sa.String(255), nullable=False),
        sa.Column("payload", json(), nullable=False),
        sa.Column("scenario_step", sa.Integer(), nullable=False),
        sa.Column("batch_number", sa.Integer(), nullable=True),
        sa.Column("base_version", sa.String(255), nullable=True),
        sa.Column("trainer_step", sa.Integer(), nullable=True),
        sa.Column("checkpoint_path", sa.Text(), nullable=True),
        sa.Column("metrics", json(), nullable=True),
        sa.Column("target_load_id", sa.String(255), nullable=True),
        sa.Column("runtime_load_id", sa.String(255), nullable=True),
        sa.Column("commit_acknowledged", sa.Boolean(), nullable=False),
        sa.Column("publish_attempts", sa.Integer(), nullable=False),
        sa.Column("ambiguity", sa.Text(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_training_jobs"),
    )
    op.create_index("ux_training_jobs_in_flight", "training_jobs", ["deployment"], unique=True,
                    sqlite_where=sa.text(IN_FLIGHT), postgresql_where=sa.text(IN_FLIGHT))

    op.create_table(
        "engines",
        *_entity_columns(),
        sa.Column("deployment", sa.String(255), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("instance", sa.String(255), nullable=True),
        sa.Column("health", sa.String(32), nullable=True),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("serving_version", sa.String(255), nullable=True),
        sa.Column("memory", json(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_engines"),
    )
    op.create_index("ix_engines_deployment", "engines", ["deployment"])

    op.create_table(
        "weight_versions",
        *_entity_columns(),
        sa.Column("deployment", sa.String(255), nullable=False),
        sa.Column("incarnation", sa.String(64), nullable=False),
        sa.Column("sequence", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(255), nullable=True),
        sa.Column("weights_path", sa.Text(), nullable=True),
        sa.Column("confirmed_by", json(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_weight_versions"),
    )
    op.create_index("ix_weight_versions_deployment", "weight_versions", ["deployment", "sequence"])


def downgrade() -> None:
    op.drop_index("ix_weight_versions_deployment", table_name="weight_versions")
    op.drop_table("weight_versions")
    op.drop_index("ix_engines_deployment", table_name="engines")
    op.drop_table("engines")
    op.drop_index("ux_training_jobs_in_flight", table_name="training_jobs")
    op.drop_table("training_jobs")
