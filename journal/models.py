"""The journal's tables.

Every entity table has ``id``, ``state``, ``version``, ``created_at`` and
``updated_at`` plus its own typed columns, so an operator can audit it with
plain SQL. ``events`` is the append-only history of every entity; ``leases``
holds the leader lease and its fencing epoch. Schema changes go through the
Alembic revisions in ``migrations/``; a test proves they match these models.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from .types import BigIntPK, JSONValue, UTCDateTime

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING)


def entity_columns() -> list[sa.Column[Any]]:
    """The columns every entity table starts with (a fresh set per table)."""
    return [
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("state", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
    ]


events = sa.Table(
    "events",
    metadata,
    sa.Column("seq", BigIntPK, primary_key=True, autoincrement=True),
    sa.Column("entity_kind", sa.String(64), nullable=False),
    sa.Column("entity_id", sa.String(255), nullable=False),
    sa.Column("from_state", sa.String(64), nullable=True),
    sa.Column("to_state", sa.String(64), nullable=False),
    # The entity's version after this event: folding checks it step by step.
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("actor", sa.String(255), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=True),
    sa.Column("payload", JSONValue(), nullable=True),
    sa.Column("ts", UTCDateTime(), nullable=False),
    sa.Index("ix_events_entity", "entity_kind", "entity_id", "seq"),
    sa.Index("ix_events_ts", "ts"),
)

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(255), nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=False),
    sa.Column("acquired_at", UTCDateTime(), nullable=False),
    sa.Column("renewed_at", UTCDateTime(), nullable=False),
    # Which journal's line of leaders this is (minted by the first one; docs/architecture.md).
    sa.Column("lineage", sa.String(32), nullable=True),
)

# Request bodies a fan-out shares, stored once as the exact JSON text every call of it sends.
# Content-addressed (``id`` is the SHA-256 of ``content``) and never changed: not an entity.
rpc_bodies = sa.Table(
    "rpc_bodies",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("content", sa.Text, nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
)

rpc_calls = sa.Table(
    "rpc_calls",
    metadata,
    *entity_columns(),
    sa.Column("entity_kind", sa.String(64), nullable=False),
    sa.Column("entity_id", sa.String(255), nullable=False),
    sa.Column("target", sa.Text, nullable=False),
    sa.Column("method", sa.String(8), nullable=False),
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("body", JSONValue(), nullable=True),
    # Or the id of a shared body in ``rpc_bodies`` (then ``body`` is NULL): a fan-out's calls all send it.
    sa.Column("body_id", sa.String(64), nullable=True),
    sa.Column("timeout_s", sa.Float, nullable=False),
    # False for calls that must never be sent twice (an optimizer step).
    sa.Column("repeatable", sa.Boolean, nullable=False),
    sa.Column("pool", sa.String(16), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
    sa.Column("result", JSONValue(), nullable=True),
    sa.Column("error", JSONValue(), nullable=True),
    sa.Index("ix_rpc_calls_owner", "entity_kind", "entity_id"),
    # The dispatcher only ever scans due pending calls; keep that scan small.
    sa.Index("ix_rpc_calls_due", "next_attempt_at",
             sqlite_where=sa.text("state = 'pending'"),
             postgresql_where=sa.text("state = 'pending'")),
    sa.Index("ix_rpc_calls_open", "state",
             sqlite_where=sa.text("state IN ('pending', 'inflight', 'ambiguous')"),
             postgresql_where=sa.text("state IN ('pending', 'inflight', 'ambiguous')")),
)

participants = sa.Table(
    "participants",
    metadata,
    *entity_columns(),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("kind", sa.String(32), nullable=True),
    sa.Column("instance", sa.String(255), nullable=True),
    sa.Column("phase", sa.String(32), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Column("probe_failures", sa.Integer, nullable=False, default=0),
    sa.Column("last_probe_at", UTCDateTime(), nullable=True),
    sa.Index("ix_participants_active", "state",
             sqlite_where=sa.text("state != 'removed'"),
             postgresql_where=sa.text("state != 'removed'")),
)

# -- the checkpoint workflows -----------------------------------------------------------------------

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    *entity_columns(),
    # Where participants write (<checkpoint_dir>/<id>/gym/...) and the checkpoint's own manifest goes.
    sa.Column("checkpoint_dir", sa.Text, nullable=False),
    # Straggler retries: the try number and the checkpoint this one retries.
    sa.Column("try_number", sa.Integer, nullable=False, default=1),
    sa.Column("retry_of", sa.String(255), nullable=True),
    sa.Column("max_tries", sa.Integer, nullable=False, default=3),
    # Index into the prepare stages (environment, model, agent, resources).
    sa.Column("stage", sa.Integer, nullable=False, default=0),
    # Absolute Unix deadline of the current phase, as sent to participants.
    sa.Column("deadline_ts", sa.Float, nullable=True),
    sa.Column("scope", JSONValue(), nullable=True),
    sa.Column("restarts", JSONValue(), nullable=True),
    # What the checkpoint continues, as the journal's rollouts stood once it was committed everywhere:
    # {"continued": [capture keys a restore continues], "not_dispatched": [up to 10,000 rollout ids],
    #  "not_dispatched_count": n}.
    sa.Column("rollouts", JSONValue(), nullable=True),
    # Why an aborted try is tried again without blockers: "export_failed" (null otherwise).
    sa.Column("retry_reason", sa.String(32), nullable=True),
    sa.Column("blockers", JSONValue(), nullable=True),
    sa.Column("manifest_path", sa.Text, nullable=True),
    sa.Column("timings", JSONValue(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Index("ix_checkpoints_open", "state",
             sqlite_where=sa.text("state NOT IN ('done', 'aborted', 'failed')"),
             postgresql_where=sa.text("state NOT IN ('done', 'aborted', 'failed')")),
)

checkpoint_members = sa.Table(
    "checkpoint_members",
    metadata,
    *entity_columns(),
    sa.Column("checkpoint_id", sa.String(255), nullable=False),
    sa.Column("participant", sa.String(255), nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("stage", sa.Integer, nullable=False),
    sa.Column("report", JSONValue(), nullable=True),
    sa.Column("manifest", JSONValue(), nullable=True),
    sa.Column("episode_ids", JSONValue(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Index("ix_checkpoint_members_checkpoint", "checkpoint_id", "stage"),
)

#: Rollout states in which some attempt may still run or is about to (see journal.machines.ROLLOUTS).
ROLLOUTS_LIVE = "state IN ('pending', 'dispatched', 'restart', 'retiring', 'ambiguous', 'errored')"

#: Finished rollouts that no training batch has taken yet (see ``training_batches``).
ROLLOUTS_UNBATCHED = "state = 'finished' AND batch_id IS NULL"

rollouts = sa.Table(
    "rollouts",
    metadata,
    *entity_columns(),
    sa.Column("attempt", sa.Integer, nullable=False, default=0),
    sa.Column("task", JSONValue(), nullable=True),
    sa.Column("result", JSONValue(), nullable=True),
    # The last published checkpoint that continued this rollout.
    sa.Column("checkpoint_id", sa.String(255), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    # The submitter's labels (free-form JSON object), returned as given.
    sa.Column("labels", JSONValue(), nullable=True),
    # The environment server (participant id) the current attempt was sent to.
    sa.Column("environment", sa.String(255), nullable=True),
    # The committed weight version when the current attempt was sent (null without training).
    sa.Column("weight_version", sa.String(255), nullable=True),
    # Attempts that ended with a typed error from the environment (the retry limit counts these).
    sa.Column("failures", sa.Integer, nullable=False, default=0, server_default="0"),
    # The outbox intent (rpc_calls.id) of the current attempt's /run.
    sa.Column("run_call", sa.String(64), nullable=True),
    # The environment server holding the current attempt's restored boundary (a restore continued
    # it there): the attempt is sent nowhere else. Null for an attempt that starts from its input.
    sa.Column("restored_on", sa.String(255), nullable=True),
    sa.Column("dispatched_at", UTCDateTime(), nullable=True),
    sa.Column("ended_at", UTCDateTime(), nullable=True),
    # The training batch (``training_batches.id``) that took this finished rollout, as a member or as
    # excluded (the batch's ``excluded`` says why); null until one did, or without batching.
    sa.Column("batch_id", sa.String(255), nullable=True),
    sa.Index("ix_rollouts_live", "state",
             sqlite_where=sa.text(ROLLOUTS_LIVE), postgresql_where=sa.text(ROLLOUTS_LIVE)),
    sa.Index("ix_rollouts_pending", "created_at", "id",
             sqlite_where=sa.text("state = 'pending'"), postgresql_where=sa.text("state = 'pending'")),
    sa.Index("ix_rollouts_done", "updated_at", "id",
             sqlite_where=sa.text("state IN ('finished', 'failed')"),
             postgresql_where=sa.text("state IN ('finished', 'failed')")),
    # The batcher's scan: finished rollouts no batch has taken yet, oldest first.
    sa.Index("ix_rollouts_unbatched", "ended_at", "id",
             sqlite_where=sa.text(ROLLOUTS_UNBATCHED), postgresql_where=sa.text(ROLLOUTS_UNBATCHED)),
)

restores = sa.Table(
    "restores",
    metadata,
    *entity_columns(),
    sa.Column("checkpoint_id", sa.String(255), nullable=False),
    sa.Column("checkpoint_dir", sa.Text, nullable=False),
    sa.Column("scope", JSONValue(), nullable=False),
    sa.Column("deadline_ts", sa.Float, nullable=True),
    sa.Column("timings", JSONValue(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
)

retirements = sa.Table(
    "retirements",
    metadata,
    *entity_columns(),
    sa.Column("op", sa.String(8), nullable=False),
    sa.Column("rollout_ids", JSONValue(), nullable=False),
    # retire: the attempts to retire (EpisodeId dicts); forget: null.
    sa.Column("episode_ids", JSONValue(), nullable=True),
    sa.Column("stage", sa.Integer, nullable=False, default=0),
    sa.Column("detail", sa.Text, nullable=True),
)

# -- training jobs and commit-gated publication (docs/training.md) ------------------------------------

#: Training-job states that count as in flight: at most one per deployment (``ux_training_jobs_in_flight``).
TRAINING_IN_FLIGHT = ("RUNNING", "AMBIGUOUS", "CHECKPOINT", "UPDATING_WEIGHTS", "READY_TO_COMMIT",
                      "HEAD_COMMITTED", "REJECTING")
_IN_FLIGHT_SQL = "state IN (" + ", ".join(f"'{s}'" for s in TRAINING_IN_FLIGHT) + ")"

training_jobs = sa.Table(
    "training_jobs",
    metadata,
    # id: the job's identity, SHA-256 of its canonical payload without scenario step, batch
    # number and base version (engine.workflows.training.identity.job_identity).
    *entity_columns(),
    sa.Column("deployment", sa.String(255), nullable=False),
    sa.Column("payload", JSONValue(), nullable=False),
    sa.Column("scenario_step", sa.Integer, nullable=False),
    sa.Column("batch_number", sa.Integer, nullable=True),
    # The runtime load id the job trains from (the committed head when it was submitted).
    sa.Column("base_version", sa.String(255), nullable=True),
    # The trainer's persisted step counter when the job was recorded RUNNING: evidence after a crash.
    sa.Column("trainer_step", sa.Integer, nullable=True),
    sa.Column("checkpoint_path", sa.Text, nullable=True),
    sa.Column("metrics", JSONValue(), nullable=True),
    # Persisted before any byte of the publication is sent; a retry reuses it.
    sa.Column("target_load_id", sa.String(255), nullable=True),
    # The version every engine was verified to serve (READY_TO_COMMIT and after).
    sa.Column("runtime_load_id", sa.String(255), nullable=True),
    sa.Column("commit_acknowledged", sa.Boolean, nullable=False, default=False),
    sa.Column("publish_attempts", sa.Integer, nullable=False, default=0),
    # Why the job is AMBIGUOUS and what would settle it.
    sa.Column("ambiguity", sa.Text, nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    # When every engine was verified on the candidate (READY_TO_COMMIT): the acknowledgement timeout
    # counts from it, across restarts.
    sa.Column("ready_at", UTCDateTime(), nullable=True),
    # When the publication began pausing the engines (written before the first pause call): while
    # the job is CHECKPOINT with it set, the engine gate pauses every engine it looks at.
    sa.Column("pause_intent_at", UTCDateTime(), nullable=True),
    # The commit gate's verdict: {"decision": "commit"|"reject", "by": "auto"|"operator"|"evaluator"|
    # "timeout", "reason", "metrics", "at"} (docs/training.md, "The commit gate").
    sa.Column("verdict", JSONValue(), nullable=True),
    # The database refuses a second job in flight for a deployment, whoever writes it.
    sa.Index("ux_training_jobs_in_flight", "deployment", unique=True,
             sqlite_where=sa.text(_IN_FLIGHT_SQL), postgresql_where=sa.text(_IN_FLIGHT_SQL)),
)

training_batches = sa.Table(
    "training_batches",
    metadata,
    # id: "<deployment>.b<number>" (engine.workflows.training.batching.batch_id).
    *entity_columns(),
    sa.Column("deployment", sa.String(255), nullable=False),
    # Counts the deployment's batches from 0; the job's scenario_step and batch_number.
    sa.Column("number", sa.Integer, nullable=False),
    # The member rollouts, in the order of the job's samples (set when the batch is submitted).
    sa.Column("rollout_ids", JSONValue(), nullable=True),
    # Finished rollouts this batch took without training them: {rollout id: why}.
    sa.Column("excluded", JSONValue(), nullable=True),
    # The committed head when the batch was submitted: the job's base_version.
    sa.Column("base_version", sa.String(255), nullable=True),
    # The training job submitted in the same write as the batch.
    sa.Column("job_id", sa.String(255), nullable=True),
    sa.Column("submitted_at", UTCDateTime(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Index("ux_training_batches_number", "deployment", "number", unique=True),
    # One batch collecting per deployment, whoever writes it.
    sa.Index("ux_training_batches_open", "deployment", unique=True,
             sqlite_where=sa.text("state = 'open'"), postgresql_where=sa.text("state = 'open'")),
)

services = sa.Table(
    "services",
    metadata,
    # id: the service's name in the stack (``deployment.services``).
    *entity_columns(),
    # uni (a local process group) or ray (a process placed on a Ray node through an actor).
    sa.Column("executor", sa.String(32), nullable=False, default="uni"),
    # The argument vector as launched (endpoints substituted). Environment values are never stored.
    sa.Column("command", JSONValue(), nullable=True),
    sa.Column("depends_on", JSONValue(), nullable=True),
    # 'up' or 'down': what the operator last asked for (``tidelog up`` / ``tidelog down``).
    sa.Column("desired", sa.String(16), nullable=False, default="up"),
    # The orchestrator (lease holder id) whose processes these are; they die with it.
    sa.Column("owner", sa.String(255), nullable=True),
    sa.Column("host", sa.String(255), nullable=True),
    # {"guard": pid, "service": pid}: the process group's leader is "service".
    sa.Column("pids", JSONValue(), nullable=True),
    # The published endpoint (``${endpoints.NAME}``), once launched.
    sa.Column("endpoint", sa.Text, nullable=True),
    sa.Column("exit_code", sa.Integer, nullable=True),
    sa.Column("restarts", sa.Integer, nullable=False, default=0, server_default="0"),
    sa.Column("log_path", sa.Text, nullable=True),
    sa.Column("started_at", UTCDateTime(), nullable=True),
    sa.Column("ready_at", UTCDateTime(), nullable=True),
    sa.Column("stopped_at", UTCDateTime(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    # The ``engines`` row (``<deployment>/<name>``) this service runs, if it is an inference engine:
    # each launch makes that row unverified, and the deployment is not ready until the gate put the
    # engine on the committed head.
    sa.Column("engine", sa.String(255), nullable=True),
)

engines = sa.Table(
    "engines",
    metadata,
    *entity_columns(),
    sa.Column("deployment", sa.String(255), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    # The engine process's identity as last observed; a different one is a replacement.
    sa.Column("instance", sa.String(255), nullable=True),
    sa.Column("health", sa.String(32), nullable=True),
    sa.Column("paused", sa.Boolean, nullable=False, default=False),
    sa.Column("serving_version", sa.String(255), nullable=True),
    # Region -> "resident" | "released" (weights, kv_cache, cuda_graph).
    sa.Column("memory", JSONValue(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Index("ix_engines_deployment", "deployment"),
)

weight_versions = sa.Table(
    "weight_versions",
    metadata,
    # id: the runtime load id, "<incarnation>:<sequence>".
    *entity_columns(),
    sa.Column("deployment", sa.String(255), nullable=False),
    sa.Column("incarnation", sa.String(64), nullable=False),
    sa.Column("sequence", sa.Integer, nullable=False),
    # The training job that produced it (null for a deployment's initial weights).
    sa.Column("job_id", sa.String(255), nullable=True),
    sa.Column("weights_path", sa.Text, nullable=True),
    # Engine ids that reported serving this version.
    sa.Column("confirmed_by", JSONValue(), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Index("ix_weight_versions_deployment", "deployment", "sequence"),
)
