"""A checkpoint records the rollouts it continues, and why a try without blockers is tried again.

New columns of ``checkpoints``: ``rollouts`` (JSON, null until the checkpoint is committed
everywhere): ``{"continued": [capture keys a restore continues], "not_dispatched": [up to 10,000
rollout ids], "not_dispatched_count": n}``, read from the journal's rollouts once every member
committed the scope (docs/rollouts.md);
``retry_reason`` (``export_failed`` when a member's export failed: the try is aborted and prepared
again under a new id; null otherwise).

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
        batch.add_column(sa.Column("retry_reason", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("retry_reason")
        batch.drop_column("rollouts")
