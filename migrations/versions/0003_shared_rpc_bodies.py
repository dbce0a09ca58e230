"""Shared RPC bodies: ``rpc_bodies`` and ``rpc_calls.body_id``.

A fan-out encodes its request body once; every intent of the fan-out references
that one stored body, so the dispatcher sends the same bytes to every target.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rpc_bodies",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("created_at", journal.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_rpc_bodies"),
    )
    op.add_column("rpc_calls", sa.Column("body_id", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("rpc_calls", "body_id")
    op.drop_table("rpc_bodies")
