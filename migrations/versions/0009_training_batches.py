"""Rollouts become training jobs: the ``training_batches`` table and ``rollouts.batch_id``.

A batch groups finished rollouts of a deployment into one training job (docs/training.md,
"Batching rollouts into jobs"). ``training_batches`` holds one row per batch: ``open`` while it
collects (at most one per deployment, ``ux_training_batches_open``), ``submitted`` once its members
are recorded and its job created in the same write, then ``trained``, ``rejected`` or ``failed`` with
the job. ``rollouts.batch_id`` names the batch that took a finished rollout (as a member, or excluded
with the reason in the batch's ``excluded``); ``ix_rollouts_unbatched`` serves the batcher's scan.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

UNBATCHED = "state = 'finished' AND batch_id IS NULL"


def upgrade() -> None:
    op.create_table(
        "training_batches",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("updated_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("deployment", sa.String(255), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("rollout_ids", journal.types.JSONValue(), nullable=True),
        sa.Column("excluded", journal.types.JSONValue(), nullable=True),
        sa.Column("base_version", sa.String(255), nullable=True),
        sa.Column("job_id", sa.String(255), nullable=True),
        sa.Column("submitted_at", journal.types.UTCDateTime(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_training_batches"),
    )
    op.create_index("ux_training_batches_number", "training_batches", ["deployment", "number"], unique=True)
    op.create_index("ux_training_batches_open", "training_batches", ["deployment"], unique=True,
                    sqlite_where=sa.text("state = 'open'"), postgresql_where=sa.text("state = 'open'"))
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(255), nullable=True))
    op.create_index("ix_rollouts_unbatched", "rollouts", ["ended_at", "id"],
                    sqlite_where=sa.text(UNBATCHED), postgresql_where=sa.text(UNBATCHED))


def downgrade() -> None:
    op.drop_index("ix_rollouts_unbatched", "rollouts")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("batch_id")
    op.drop_index("ux_training_batches_open", "training_batches")
    op.drop_index("ux_training_batches_number", "training_batches")
    op.drop_table("training_batches")
