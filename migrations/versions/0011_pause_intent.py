"""Pause intent: ``training_jobs.pause_intent_at``.

When a publication began pausing the engines (written before the first pause call, so a crash or a
partial pause failure leaves it recorded). While the job is ``CHECKPOINT`` with it set, the engine
gate pauses every engine it looks at, a replacement included: the pause barrier holds on retry.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.add_column(sa.Column("pause_intent_at", journal.types.UTCDateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("training_jobs") as batch:
        batch.drop_column("pause_intent_at")
