"""Initial journal: events (append-only), leases, rpc_calls outbox, participants.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import journal.types

revision = "0001"
down_revision = None
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


_APPEND_ONLY_PG = """
CREATE FUNCTION tidelog_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events is append-only: % refused', TG_OP USING ERRCODE = 'restrict_violation';
END;
$$;
"""


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("seq", journal.types.BigIntPK, autoincrement=True, nullable=False),
        sa.Column("entity_kind", sa.String(64), nullable=False),
        sa.Column("entity_id", sa.String(255), nullable=False),
        sa.Column("from_state", sa.String(64), nullable=True),
        sa.Column("to_state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=True),
        sa.Column("payload", journal.types.JSONValue(), nullable=True),
        sa.Column("ts", journal.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_events"),
    )
    op.create_index("ix_events_entity", "events", ["entity_kind", "entity_id", "seq"])
    op.create_index("ix_events_ts", "events", ["ts"])

    op.create_table(
        "leases",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("acquired_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("renewed_at", journal.types.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_leases"),
    )

    op.create_table(
        "rpc_calls",
        *_entity_columns(),
        sa.Column("entity_kind", sa.String(64), nullable=False),
        sa.Column("entity_id", sa.String(255), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("body", journal.types.JSONValue(), nullable=True),
        sa.Column("timeout_s", sa.Float(), nullable=False),
        sa.Column("repeatable", sa.Boolean(), nullable=False),
        sa.Column("pool", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", journal.types.UTCDateTime(), nullable=False),
        sa.Column("result", journal.types.JSONValue(), nullable=True),
        sa.Column("error", journal.types.JSONValue(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_rpc_calls"),
    )
    op.create_index("ix_rpc_calls_owner", "rpc_calls", ["entity_kind", "entity_id"])
    op.create_index("ix_rpc_calls_due", "rpc_calls", ["next_attempt_at"],
                    sqlite_where=sa.text("state = 'pending'"),
                    postgresql_where=sa.text("state = 'pending'"))
    op.create_index("ix_rpc_calls_open", "rpc_calls", ["state"],
                    sqlite_where=sa.text("state IN ('pending', 'inflight', 'ambiguous')"),
                    postgresql_where=sa.text("state IN ('pending', 'inflight', 'ambiguous')"))

    op.create_table(
        "participants",
        *_entity_columns(),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=True),
        sa.Column("instance", sa.String(255), nullable=True),
        sa.Column("phase", sa.String(32), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("probe_failures", sa.Integer(), nullable=False),
        sa.Column("last_probe_at", journal.types.UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_participants"),
    )
    op.create_index("ix_participants_active", "participants", ["state"],
                    sqlite_where=sa.text("state != 'removed'"),
                    postgresql_where=sa.text("state != 'removed'"))

    # The audit log is append-only on both backends, enforced by the database itself.
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_APPEND_ONLY_PG)
        op.execute("CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events "
                   "FOR EACH ROW EXECUTE FUNCTION tidelog_events_append_only()")
        op.execute("CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
                   "FOR EACH STATEMENT EXECUTE FUNCTION tidelog_events_append_only()")
    else:
        op.execute("CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
                   "BEGIN SELECT RAISE(ABORT, 'events is append-only: UPDATE refused'); END")
        op.execute("CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
                   "BEGIN SELECT RAISE(ABORT, 'events is append-only: DELETE refused'); END")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
        op.execute("DROP TRIGGER IF EXISTS events_append_only ON events")
        op.execute("DROP FUNCTION IF EXISTS tidelog_events_append_only()")
    else:
        op.execute("DROP TRIGGER IF EXISTS events_no_delete")
        op.execute("DROP TRIGGER IF EXISTS events_no_update")
    op.drop_index("ix_participants_active", table_name="participants")
    op.drop_table("participants")
    op.drop_index("ix_rpc_calls_open", table_name="rpc_calls")
    op.drop_index("ix_rpc_calls_due", table_name="rpc_calls")
    op.drop_index("ix_rpc_calls_owner", table_name="rpc_calls")
    op.drop_table("rpc_calls")
    op.drop_table("leases")
    op.drop_index("ix_events_ts", table_name="events")
    op.drop_index("ix_events_entity", table_name="events")
    op.drop_table("events")
