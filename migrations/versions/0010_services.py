"""The deployment as rows: the ``services`` table (docs/deployment.md).

One row per service of the stack that ``deployment.services`` declares: its state (``pending``,
``starting``, ``ready``, ``failed``, ``restarting``, ``stopping``, ``stopped``), the orchestrator that
owns its processes, where they run (host, pids, log), its published endpoint, exit code and restarts,
and when it started, became ready and stopped, and the ``engines`` row it runs if it is an inference
engine. Environment values are never stored.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "services",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("updated_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("executor", sa.String(32), nullable=False),
        sa.Column("command", journal.types.JSONValue(), nullable=True),
        sa.Column("depends_on", journal.types.JSONValue(), nullable=True),
        sa.Column("desired", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("pids", journal.types.JSONValue(), nullable=True),
        sa.Column("endpoint", sa.Text(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("restarts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("started_at", journal.types.UTCDateTime(), nullable=True),
        sa.Column("ready_at", journal.types.UTCDateTime(), nullable=True),
        sa.Column("stopped_at", journal.types.UTCDateTime(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("engine", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_services"),
    )


def downgrade() -> None:
    op.drop_table("services")
