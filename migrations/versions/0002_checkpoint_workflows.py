"""Checkpoint workflows: checkpoints, checkpoint_members, rollouts, restores, retirements.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _entity_columns() -> list[sa.Column]:
    return [
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("updated_at", journal.types.UTCDateTime(), nullable=False),
    ]


def _partial(name: str, table: str, columns: list[str], where: str) -> None:
    op.create_index(name, table, columns, sqlite_where=sa.text(where), postgresql_where=sa.text(where))


def upgrade() -> None:
    json = journal.types.JSONValue
    op.create_table(
        "checkpoints",
        *_entity_columns(),
        sa.Column("checkpoint_dir", sa.Text(), nullable=False),
        sa.Column("try_number", sa.Integer(), nullable=False),
        sa.Column("retry_of", sa.String(255), nullable=True),
        sa.Column("max_tries", sa.Integer(), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("deadline_ts", sa.Float(), nullable=True),
        sa.Column("scope", json(), nullable=True),
        sa.Column("restarts", json(), nullable=True),
        sa.Column("blockers", json(), nullable=True),
        sa.Column("manifest_path", sa.Text(), nullable=True),
        sa.Column("timings", json(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
    )
    _partial("ix_checkpoints_open", "checkpoints", ["state"], "state NOT IN ('done', 'aborted', 'failed')")

    op.create_table(
        "checkpoint_members",
        *_entity_columns(),
        sa.Column("checkpoint_id", sa.String(255), nullable=False),
        sa.Column("participant", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("report", json(), nullable=True),
        sa.Column("manifest", json(), nullable=True),
        sa.Column("episode_ids", json(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoint_members"),
    )
    op.create_index("ix_checkpoint_members_checkpoint", "checkpoint_members", ["checkpoint_id", "stage"])

    op.create_table(
        "rollouts",
        *_entity_columns(),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("task", json(), nullable=True),
        sa.Column("result", json(), nullable=True),
        sa.Column("checkpoint_id", sa.String(255), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_rollouts"),
    )
    _partial("ix_rollouts_live", "rollouts", ["state"], "state IN ('dispatched', 'restart', 'retiring')")

    op.create_table(
        "restores",
        *_entity_columns(),
        sa.Column("checkpoint_id", sa.String(255), nullable=False),
        sa.Column("checkpoint_dir", sa.Text(), nullable=False),
        sa.Column("scope", json(), nullable=False),
        sa.Column("deadline_ts", sa.Float(), nullable=True),
        sa.Column("timings", json(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_restores"),
    )

    op.create_table(
        "retirements",
        *_entity_columns(),
        sa.Column("op", sa.String(8), nullable=False),
        sa.Column("rollout_ids", json(), nullable=False),
        sa.Column("episode_ids", json(), nullable=True),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_retirements"),
    )


def downgrade() -> None:
    op.drop_table("retirements")
    op.drop_table("restores")
    op.drop_index("ix_rollouts_live", table_name="rollouts")
    op.drop_table("rollouts")
    op.drop_index("ix_checkpoint_members_checkpoint", table_name="checkpoint_members")
    op.drop_table("checkpoint_members")
    op.drop_index("ix_checkpoints_open", table_name="checkpoints")
    op.drop_table("checkpoints")
