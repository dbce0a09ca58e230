"""A checkpoint records the rollouts it continues.

New column of ``checkpoints``: ``rollouts`` (JSON, null until the checkpoint is committed
everywhere): ``{"continued": [capture keys a restore continues], "not_dispatched": [rollout ids]}``,
read from the journal's rollouts once every member committed the scope (docs/rollouts.md).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("rollouts", journal.types.JSONValue(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("rollouts")
