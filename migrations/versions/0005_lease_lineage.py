"""The lease's lineage: ``leases.lineage``, the identity of one journal's line of leaders.

Minted by the first leader of a journal (the insert of its lease row; a row an older version left
without one gets it at its next take-over) and never changed. The orchestrator sends it beside its
epoch, and a participant keeps the highest epoch per lineage, so a journal made again (or a second
one pointed at the same participants) starts a fencing line of its own instead of being refused
for ever by epochs another journal reached.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("leases", sa.Column("lineage", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("lineage")
