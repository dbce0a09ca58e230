"""The commit gate waits for its verdict: new columns of ``training_jobs``.

``ready_at`` (when every engine was verified on the candidate, entering ``READY_TO_COMMIT``; the
acknowledgement timeout counts from it) and ``verdict`` (JSON: the decision, who made it — ``auto``,
``operator``, ``evaluator`` or ``timeout`` — the reason, an evaluator's metrics, and when).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("ready_at", journal.types.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("verdict", journal.types.JSONValue(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.drop_column("verdict")
        batch.drop_column("ready_at")
