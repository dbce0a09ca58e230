"""Rollouts owned by the journal: a submitted rollout is a row, every attempt of it a step of that row.

New columns of ``rollouts``: ``labels`` (the submitter's, free-form), ``environment`` (the
environment server the current attempt was sent to), ``weight_version`` (the committed weight
version when it was sent; null without training), ``failures`` (attempts that ended with a typed
error), ``run_call`` (the outbox intent of the current attempt's ``/run``), ``restored_on`` (the
environment server holding the restored boundary of the current attempt, where it must be sent),
``dispatched_at`` and ``ended_at``. The live index covers the new states (``pending``, ``ambiguous``, ``errored``); two
partial indexes serve the dispatcher (``pending`` rows, oldest first) and forgetting (``finished`` and
``failed`` rows).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

LIVE = "state IN ('pending', 'dispatched', 'restart', 'retiring', 'ambiguous', 'errored')"
OLD_LIVE = "state IN ('dispatched', 'restart', 'retiring')"


def _partial(name: str, columns: list[str], where: str) -> None:
    op.create_index(name, "rollouts", columns, sqlite_where=sa.text(where), postgresql_where=sa.text(where))


def upgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("labels", journal.types.JSONValue(), nullable=True))
        batch.add_column(sa.Column("environment", sa.String(255), nullable=True))
        batch.add_column(sa.Column("weight_version", sa.String(255), nullable=True))
        batch.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("run_call", sa.String(64), nullable=True))
        batch.add_column(sa.Column("restored_on", sa.String(255), nullable=True))
        batch.add_column(sa.Column("dispatched_at", journal.types.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column("ended_at", journal.types.UTCDateTime(), nullable=True))
    op.drop_index("ix_rollouts_live", "rollouts")
    _partial("ix_rollouts_live", ["state"], LIVE)
    _partial("ix_rollouts_pending", ["created_at", "id"], "state = 'pending'")
    _partial("ix_rollouts_done", ["updated_at", "id"], "state IN ('finished', 'failed')")


def downgrade() -> None:
    op.drop_index("ix_rollouts_done", "rollouts")
    op.drop_index("ix_rollouts_pending", "rollouts")
    op.drop_index("ix_rollouts_live", "rollouts")
    _partial("ix_rollouts_live", ["state"], OLD_LIVE)
    with op.batch_alter_table("rollouts") as batch:
        for name in ("ended_at", "dispatched_at", "restored_on", "run_call", "failures", "weight_version", "environment", "labels"):
            batch.drop_column(name)
