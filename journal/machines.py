"""State machines as data.

A :class:`StateMachine` names a kind's states, the states a row may be created
in, its legal edges and its terminal states. The journal checks every write
against it before touching the database; nothing else decides legality.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from .errors import IllegalTransition, UnknownState


@dataclass(frozen=True)
class StateMachine:
    """The legal life of one entity kind.

    Invariants (checked at construction): every edge endpoint is a state;
    terminal states have no outgoing edges; initial states are states.
    """

    kind: str
    initial: frozenset[str]
    edges: Mapping[str, frozenset[str]]
    terminal: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def build(cls, kind: str, *, initial: Iterable[str], edges: Mapping[str, Iterable[str]],
              terminal: Iterable[str] = ()) -> StateMachine:
        return cls(kind, frozenset(initial), {k: frozenset(v) for k, v in edges.items()},
                   frozenset(terminal))

    def __post_init__(self) -> None:
        # ``states`` is derived from the edges, so check destinations against the states
        # declared on their own (initial, terminal, or a source of edges): a misspelt
        # destination would otherwise silently become a new dead-end state.
        declared = self.initial | self.terminal | set(self.edges)
        for src, dsts in self.edges.items():
            for dst in dsts:
                if dst not in declared:
                    raise ValueError(f"{self.kind}: edge {src} -> {dst} ends outside the machine")
            if src in self.terminal and dsts:
                raise ValueError(f"{self.kind}: terminal state {src!r} has outgoing edges")
        if not self.initial:
            raise ValueError(f"{self.kind}: a machine needs at least one initial state")

    @cached_property  # checked on every write; a machine never changes
    def states(self) -> frozenset[str]:
        out = set(self.initial) | set(self.terminal) | set(self.edges)
        for dsts in self.edges.values():
            out |= dsts
        return frozenset(out)

    @cached_property
    def active(self) -> frozenset[str]:
        """States the reconciler still has to look at."""
        return self.states - self.terminal

    def allowed(self, from_state: str) -> frozenset[str]:
        return self.edges.get(from_state, frozenset())

    def check_state(self, state: str) -> None:
        if state not in self.states:
            raise UnknownState(self.kind, state, self.states)

    def check_initial(self, entity_id: str, state: str) -> None:
        self.check_state(state)
        if state not in self.initial:
            raise IllegalTransition(self.kind, entity_id, None, state, self.initial)

    def check(self, entity_id: str, from_state: str, to_state: str) -> None:
        """Raise :class:`IllegalTransition` unless ``from_state -> to_state`` is an edge."""
        self.check_state(from_state)
        self.check_state(to_state)
        if to_state not in self.allowed(from_state):
            raise IllegalTransition(self.kind, entity_id, from_state, to_state, self.allowed(from_state))

    def edge_list(self) -> list[tuple[str, str]]:
        return sorted((s, d) for s, dsts in self.edges.items() for d in dsts)

    def mermaid(self) -> str:
        """The machine as a mermaid ``stateDiagram-v2`` (used by docs/architecture.md)."""
        lines = ["stateDiagram-v2"]
        lines += [f"    [*] --> {s}" for s in sorted(self.initial)]
        lines += [f"    {s} --> {d}" for s, d in self.edge_list()]
        lines += [f"    {s} --> [*]" for s in sorted(self.terminal)]
        return "\n".join(lines)


PARTICIPANTS = StateMachine.build(
    "participants",
    # A configured server starts `pending` until its first probe answers.
    initial=["pending"],
    edges={
        "pending": ["healthy", "unreachable", "incompatible", "removed"],
        # Self-edges record a change of phase/instance/failure count on a live row.
        "healthy": ["healthy", "unreachable", "incompatible", "removed"],
        "unreachable": ["unreachable", "healthy", "incompatible", "removed"],
        "incompatible": ["incompatible", "healthy", "unreachable", "removed"],
        # A server put back into the configuration is probed again from scratch.
        "removed": ["pending"],
    },
)

RPC_CALLS = StateMachine.build(
    "rpc_calls",
    # Created inflight: a repeatable call claimed by the orchestrator that writes it, whose own
    # dispatcher sends it after the commit (journal.outbox.ensure_all with claim=True).
    initial=["pending", "inflight"],
    edges={
        "pending": ["inflight", "failed"],
        # inflight -> pending: a transport error with attempts left, or recovery of a
        # repeatable call found in flight after a crash (same idempotency key).
        "inflight": ["succeeded", "failed", "pending", "ambiguous"],
        # An ambiguous call (not safe to repeat, outcome unknown) is settled from evidence
        # or by an operator, never by re-sending it.
        "ambiguous": ["succeeded", "failed"],
    },
    terminal=["succeeded", "failed"],
)

# -- the checkpoint workflows (docs/checkpointing.md) ---------------------------------------------

CHECKPOINTS = StateMachine.build(
    "checkpoints",
    initial=["preparing"],
    edges={
        # Self-edge: the next prepare stage (environment -> model -> agent -> resources).
        "preparing": ["preparing", "prepared", "aborting", "failed"],
        "prepared": ["committing", "aborting"],
        # Self-edge: the environment's commit fixed the scope; everyone else commits it next.
        "committing": ["committing", "committed", "aborting"],
        # Published: the checkpoint's manifest and then LATEST are durable.
        "committed": ["published", "aborting"],
        "published": ["resuming"],
        "resuming": ["done"],
        # Abort = resume everyone without publishing (a straggler retry starts a new row).
        "aborting": ["aborted"],
    },
    terminal=["done", "aborted", "failed"],
)

CHECKPOINT_MEMBERS = StateMachine.build(
    "checkpoint_members",
    initial=["pending"],
    edges={
        "pending": ["preparing", "resuming"],
        # not_ready: the prepare deadline passed with blockers (the participant stays closed).
        "preparing": ["prepared", "not_ready", "failed", "resuming"],
        "prepared": ["committing", "resuming"],
        "not_ready": ["resuming"],
        "committing": ["committed", "failed", "resuming"],
        "committed": ["resuming"],
        "failed": ["resuming"],
        "resuming": ["resumed"],
    },
    terminal=["resumed"],
)

ROLLOUTS = StateMachine.build(
    "rollouts",
    # pending: submitted (or its next attempt queued), waiting for a dispatch slot. dispatched as an
    # initial state: a row written by a controller that sends /run itself (tests, older callers).
    initial=["pending", "dispatched"],
    edges={
        # Self-edge on pending: a restore continues the rollout as a later attempt before it was sent.
        "pending": ["pending", "dispatched"],
        # Self-edge on dispatched: a restore continues the attempt as the next one. -> pending: the
        # environment refused to start the attempt (a checkpoint was open, or the call never left).
        "dispatched": ["dispatched", "pending", "finished", "restart", "retiring", "ambiguous", "errored"],
        # ambiguous: the /run's outcome is unknown (in flight when the orchestrator died); errored:
        # the attempt ended with a typed error. Both are retired everywhere before the next attempt.
        # -> pending (from ambiguous, errored, retiring): a restore continues the rollout from its
        # checkpointed boundary as the next attempt, so this attempt is not retired and rerun.
        "ambiguous": ["retiring", "pending"],
        "errored": ["retiring", "pending"],
        "restart": ["finished", "retiring"],
        # Self-edge on retiring: its rerun retirement failed (a participant down past the deadline)
        # and is requested again under a new id.
        "retiring": ["retiring", "retired", "pending"],
        # -> pending: run again as the next attempt; -> failed: the retry limit was reached.
        "retired": ["dispatched", "pending", "failed", "forgotten"],
        # Self-edge on finished: a training batch took it (``batch_id``), as a member or excluded.
        "finished": ["finished", "forgotten"],
        "failed": ["forgotten"],
    },
    terminal=["forgotten"],
)

RESTORES = StateMachine.build(
    "restores",
    initial=["restoring"],
    edges={
        "restoring": ["resuming", "rolling_back"],
        "resuming": ["done"],
        # A failed restore retires the replacement attempts everywhere, resumes everyone, fails.
        "rolling_back": ["failed"],
    },
    terminal=["done", "failed"],
)

RETIREMENTS = StateMachine.build(
    "retirements",
    initial=["queued"],
    edges={
        # Queued while a checkpoint is open; then stage by stage (callers first).
        "queued": ["running"],
        "running": ["running", "done", "failed"],
    },
    terminal=["done", "failed"],
)


# -- training jobs and commit-gated publication (docs/training.md) ---------------------------------

TRAINING_JOBS = StateMachine.build(
    "training_jobs",
    # RUNNING is recorded (committed) before the trainer is called.
    initial=["RUNNING"],
    edges={
        # FAILED: the trainer refused the job before any step (the step record does not name it).
        # AMBIGUOUS: found RUNNING after a crash, or train failed, without durable evidence either way.
        # Self-edge: the trainer could not be made ready before train was called (said in detail).
        "RUNNING": ["RUNNING", "CHECKPOINT", "AMBIGUOUS", "FAILED"],
        # Settled from evidence (a verified checkpoint carrying the job id: CHECKPOINT; the step
        # record proving the step never ran: RUNNING again), or by an operator (also FAILED).
        # Self-edge: what is known changed, still not enough to decide.
        "AMBIGUOUS": ["AMBIGUOUS", "CHECKPOINT", "RUNNING", "FAILED"],
        # Self-edge: pausing the engines failed (said in detail); the publication is tried again
        # from here, nothing allocated yet.
        "CHECKPOINT": ["CHECKPOINT", "UPDATING_WEIGHTS", "REJECTING"],
        # Self-edge: a retry after a failed transfer (engines recovered, full transfer forced).
        "UPDATING_WEIGHTS": ["UPDATING_WEIGHTS", "READY_TO_COMMIT", "REJECTING"],
        # Engines stay paused here until the head commit; an operator may still reject.
        # Self-edge: an operator's acknowledgement recorded (the verdict), or a failed evaluation or
        # a wait held past its timeout said in detail.
        "READY_TO_COMMIT": ["READY_TO_COMMIT", "HEAD_COMMITTED", "REJECTING"],
        # Self-edge: resuming the engines failed (recorded in detail); it is tried again.
        "HEAD_COMMITTED": ["HEAD_COMMITTED", "COMPLETE"],
        # Rejection restores the incumbent weights on every engine, then resumes them.
        # Self-edge: restoring failed or needs an operator (recorded in detail).
        "REJECTING": ["REJECTING", "REJECTED"],
    },
    terminal=["COMPLETE", "REJECTED", "FAILED"],
)

TRAINING_BATCHES = StateMachine.build(
    "training_batches",
    # open: collecting (one per deployment); finished rollouts wait unbatched until it is submitted.
    initial=["open"],
    edges={
        # Self-edge: finished rollouts were excluded (recorded with why); -> submitted: the members
        # are recorded and the job created in the same write.
        "open": ["open", "submitted"],
        # The job's end: COMPLETE, REJECTED, FAILED.
        "submitted": ["trained", "rejected", "failed"],
    },
    terminal=["trained", "rejected", "failed"],
)

ENGINES = StateMachine.build(
    "engines",
    # registered: configured, not yet probed.
    initial=["registered"],
    edges={
        "registered": ["serving", "paused", "uncertain", "unreachable", "unverified", "retired"],
        # Self-edges record a new serving version, memory state or instance.
        # -> unverified: at every election (sync_engines), in the write that syncs the rows: what a
        # row says from before it is not taken for the truth until the gate has looked again.
        "serving": ["serving", "paused", "uncertain", "unreachable", "unverified", "retired"],
        "paused": ["paused", "serving", "uncertain", "unreachable", "unverified", "retired"],
        # Uncertain: a failed region or weight call; refused until the engine is replaced.
        "uncertain": ["uncertain", "paused", "serving", "unreachable", "unverified", "retired"],
        "unreachable": ["unreachable", "paused", "serving", "uncertain", "unverified", "retired"],
        # Unverified: claims no version (serving_version and health are cleared; detail keeps what
        # the row said before); left only once the gate has looked at the engine under this leader.
        "unverified": ["serving", "paused", "uncertain", "unreachable", "retired"],
        "retired": ["registered"],
    },
)

SERVICES = StateMachine.build(
    "services",
    # pending: declared by the configuration, not launched (yet, or again).
    initial=["pending"],
    edges={
        # -> stopped: never launched (the stack failed, or was brought down, before its turn);
        # -> failed: its command could not be started.
        "pending": ["starting", "failed", "stopped"],
        # starting: its process runs and its readiness deadline counts from the launch.
        "starting": ["ready", "failed", "stopping"],
        "ready": ["failed", "stopping"],
        # failed: its process is gone (an exit, a readiness that never came, an owner lost); ->
        # restarting: managed recovery rebuilds it; -> pending: brought up again; -> stopped: brought down.
        "failed": ["restarting", "pending", "stopped"],
        "restarting": ["starting", "failed", "stopped"],
        # stopping -> failed: its process group could not be confirmed gone.
        "stopping": ["stopped", "failed"],
        # Self-edge: no longer declared (``desired = 'removed'``: it no longer holds the deployment).
        "stopped": ["pending", "stopped"],
    },
)

WEIGHT_VERSIONS = StateMachine.build(
    "weight_versions",
    # target: allocated and persisted before any byte is sent; committed: a deployment's initial weights.
    initial=["target", "committed"],
    edges={
        # Self-edge: another engine confirmed it.
        "target": ["target", "loaded", "rejected"],
        "loaded": ["committed", "rejected"],
    },
    terminal=["committed", "rejected"],
)
