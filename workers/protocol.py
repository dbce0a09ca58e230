"""Wire models of the partial-rollout checkpoint protocol, shared by orchestrator and participants.

This is the one module both sides import. Routes live under
``/ng-control/v1/checkpoint/``: ``GET status`` and ``POST prepare, renew,
retire, forget, commit, restore, resume``. Every request body forbids unknown
fields and carries a ``checkpoint_id`` and an absolute ``deadline_ts``; every
typed error is ``{"error": {"code": ..., "detail": ...}}`` with the status its
code implies (:data:`ERROR_STATUS`). Replies allow the extras a participant
adds to them.

Episode identity: an attempt of a rollout is ``EpisodeId(rollout_id, attempt)``,
keyed on the wire by its capture key — ``r`` for attempt 0, ``r-aN`` after.
The suffix ``-a<N>`` (N without a leading zero, N >= 1) is therefore reserved
and refused inside rollout ids; ``r-a0`` and ``r-a01`` are ordinary ids.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

CONTROL_PREFIX = "/ng-control/v1/checkpoint"
STATUS_PATH = f"{CONTROL_PREFIX}/status"
#: The orchestrator's fencing epoch, sent on every call, and the journal's line of leaders it
#: belongs to (``leases.lineage``). A participant keeps the highest epoch it has seen per lineage
#: and refuses a lower one (``stale_epoch``), so a paused or partitioned old leader changes nothing,
#: while a journal made again starts a line of its own.
EPOCH_HEADER = "X-Tidelog-Epoch"
LINEAGE_HEADER = "X-Tidelog-Lineage"
ROUTES: tuple[str, ...] = ("prepare", "renew", "retire", "forget", "commit", "restore", "resume")

#: Participant kinds in prepare order (callers before callees).
KINDS: tuple[str, ...] = ("environment", "model", "agent", "resources")
Kind = Literal["environment", "model", "agent", "resources"]
PHASES: tuple[str, ...] = ("idle", "preparing", "prepared", "committed", "restored")
Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]

#: Checkpoint ids and rollout ids: a letter or digit, then letters, digits, ``.``, ``_``, ``-``.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
#: The attempt suffix of a capture key; reserved, so never part of a rollout id.
ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")
MAX_BLOCKERS_LISTED = 100

CheckpointId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=ID_PATTERN)]
RolloutId = Annotated[str, StringConstraints(min_length=1, max_length=255, pattern=ID_PATTERN)]
#: An absolute Unix time in seconds: a JSON number (not a string), finite.
Timestamp = Annotated[float, Field(strict=True, allow_inf_nan=False)]
#: The furthest a request's ``deadline_ts`` may lie past the participant's clock (7 days): a
#: deadline sets a lease (``deadline_ts + lease_grace_seconds``), and one that never comes — ``1e308``,
#: or milliseconds sent for seconds — would hold a participant's admission closed for good.
MAX_DEADLINE_AHEAD_S = 7 * 24 * 3600.0
#: The longest ``checkpoint_dir`` a commit or restore may name (Linux's ``PATH_MAX``).
MAX_CHECKPOINT_DIR_CHARS = 4096


class ErrorCode(str, Enum):
    """Typed error codes (control plane first, then the data plane's admission errors)."""

    UNAUTHORIZED = "unauthorized"
    STALE_CHECKPOINT = "stale_checkpoint"
    CHECKPOINT_CONFLICT = "checkpoint_conflict"
    INVALID_PHASE = "invalid_phase"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RESTART_IN_SCOPE = "restart_in_scope"
    STALE_ATTEMPT = "stale_attempt"
    EXPORT_FAILED = "export_failed"
    INVALID_CHECKPOINT_STATE = "invalid_checkpoint_state"
    CHECKPOINT_PARKED = "checkpoint_parked"
    ADMISSION_CLOSED = "admission_closed"
    ROLLOUT_ID_REQUIRED = "rollout_id_required"
    #: A body that is not JSON or does not fit its request model (the detail names the field).
    INVALID_REQUEST = "invalid_request"
    #: A body larger than the server accepts (its ``client_max_size``).
    REQUEST_TOO_LARGE = "request_too_large"
    #: A commit's or restore's ``checkpoint_dir`` outside the participant's checkpoint root: relative,
    #: not under the root, or reaching through a symbolic link (the detail names the rule).
    CHECKPOINT_DIR_REFUSED = "checkpoint_dir_refused"
    #: A request body still arriving when the server's body deadline passed (the connection is closed).
    BODY_TIMEOUT = "body_timeout"
    #: A mutating request from an orchestrator whose epoch is lower than the highest this
    #: participant has seen in its lineage: a newer leader has taken over.
    STALE_EPOCH = "stale_epoch"


#: The HTTP status each code is sent with.
ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.STALE_CHECKPOINT: 409,
    ErrorCode.CHECKPOINT_CONFLICT: 409,
    ErrorCode.INVALID_PHASE: 409,
    ErrorCode.DEADLINE_EXCEEDED: 409,
    ErrorCode.RESTART_IN_SCOPE: 409,
    ErrorCode.STALE_ATTEMPT: 409,
    ErrorCode.EXPORT_FAILED: 409,
    ErrorCode.INVALID_CHECKPOINT_STATE: 422,
    ErrorCode.CHECKPOINT_PARKED: 409,
    ErrorCode.ADMISSION_CLOSED: 409,
    ErrorCode.ROLLOUT_ID_REQUIRED: 400,
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.REQUEST_TOO_LARGE: 413,
    ErrorCode.CHECKPOINT_DIR_REFUSED: 422,
    ErrorCode.BODY_TIMEOUT: 408,
    ErrorCode.STALE_EPOCH: 409,
}


class ProtocolError(Exception):
    """A typed protocol error; a participant answers it as ``{"error": {...}}`` with :attr:`status`."""

    def __init__(self, code: ErrorCode, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code.value}: {detail}")

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def body(self) -> dict[str, Any]:
        return ErrorBody(error=ErrorDetail(code=self.code.value, detail=self.detail)).model_dump()


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    detail: str


class ErrorBody(BaseModel):
    """``{"error": {"code": ..., "detail": ...}}`` — every typed error on the wire."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


# -- episode identity ---------------------------------------------------------------------------

def capture_key(rollout_id: str, attempt: int) -> str:
    """The capture key of ``attempt`` of ``rollout_id``: ``r`` for attempt 0, ``r-aN`` after it (what
    :attr:`EpisodeId.capture_key` says, without building the model, for ids already checked)."""
    return rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"


def split_capture_key(key: str) -> tuple[str, int]:
    """``(rollout id, attempt)`` of a capture key (:meth:`EpisodeId.from_capture_key` without the model
    and its checks: for keys this side made, where thousands are read at once)."""
    match = ATTEMPT_SUFFIX.search(key)
    return (key, 0) if match is None else (key[:match.start()], int(match.group(1)))


class EpisodeId(_Request):
    """One attempt of one rollout. ``attempt`` 0 is the first; a restore continues N as N + 1."""

    rollout_id: RolloutId
    attempt: int = Field(default=0, ge=0, strict=True)

    @field_validator("rollout_id")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        match = ATTEMPT_SUFFIX.search(v)
        if match:
            raise ValueError(f"rollout id {v!r} ends with the reserved attempt suffix -a{match.group(1)} "
                             f"(it would name attempt {match.group(1)} of {v[:match.start()]!r})")
        return v

    @property
    def capture_key(self) -> str:
        return capture_key(self.rollout_id, self.attempt)

    @classmethod
    def from_capture_key(cls, key: str) -> EpisodeId:
        """Parse ``r`` or ``r-aN`` back into the rollout and attempt it names."""
        rollout_id, attempt = split_capture_key(key)
        return cls(rollout_id=rollout_id, attempt=attempt)

    def next_attempt(self) -> EpisodeId:
        return EpisodeId(rollout_id=self.rollout_id, attempt=self.attempt + 1)


# -- requests ----------------------------------------------------------------------------------

class CheckpointRequest(_Request):
    """The base of every control request: which checkpoint, and until when."""

    checkpoint_id: CheckpointId
    deadline_ts: Timestamp


class PrepareRequest(CheckpointRequest):
    pass


class RenewRequest(CheckpointRequest):
    pass


class ResumeRequest(CheckpointRequest):
    pass


class RetireRequest(CheckpointRequest):
    episode_ids: list[EpisodeId] = Field(min_length=1)


class ForgetRequest(CheckpointRequest):
    rollout_ids: list[RolloutId] = Field(min_length=1)

    @field_validator("rollout_ids")
    @classmethod
    def _not_reserved(cls, v: list[str]) -> list[str]:
        for rollout_id in v:
            EpisodeId(rollout_id=rollout_id)
        return v


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("holds a NUL byte, which no path may contain")
    return value


#: A checkpoint directory as sent: 1 to :data:`MAX_CHECKPOINT_DIR_CHARS` characters, no NUL. Whether
#: a participant accepts it (absolute, under its checkpoint root, no symbolic link) is its own check.
CheckpointDir = Annotated[str, StringConstraints(min_length=1, max_length=MAX_CHECKPOINT_DIR_CHARS),
                          AfterValidator(_no_nul)]


class CommitRequest(CheckpointRequest):
    checkpoint_dir: CheckpointDir
    #: The scope: every episode the controller continues (``None``: whatever is exported).
    episode_ids: list[EpisodeId] | None = None
    stop: bool = False


class RestoreRequest(CheckpointRequest):
    checkpoint_dir: CheckpointDir
    episode_ids: list[EpisodeId]


REQUEST_MODELS: dict[str, type[CheckpointRequest]] = {
    "prepare": PrepareRequest, "renew": RenewRequest, "retire": RetireRequest, "forget": ForgetRequest,
    "commit": CommitRequest, "restore": RestoreRequest, "resume": ResumeRequest,
}


def scope_keys(episodes: list[EpisodeId] | None) -> tuple[str, ...] | None:
    """A scope as compared between retries: the sorted set of capture keys."""
    return None if episodes is None else tuple(sorted({e.capture_key for e in episodes}))


# -- replies -----------------------------------------------------------------------------------

class PrepareReport(_Reply):
    """Readiness: at most :data:`MAX_BLOCKERS_LISTED` blockers listed, the count exact, restarts all."""

    ready: bool
    blockers: list[str] = Field(default_factory=list)
    blocker_count: int = Field(default=0, ge=0)
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[str] = Field(default_factory=list)


class StatusReply(_Reply):
    """``GET status``: who the participant is and where it stands."""

    kind: str
    instance: str = Field(min_length=1, max_length=255)
    phase: Phase
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    retired_rollouts: int = Field(default=0, ge=0)
    #: The highest orchestrator epoch seen, per lineage (``""`` for calls that name none).
    epochs: dict[str, int] = Field(default_factory=dict)
    #: Requests refused ``stale_epoch`` since this process started (an old leader still calling).
    stale_epochs_refused: int = Field(default=0, ge=0)
    report: PrepareReport | None = None


class PrepareReply(_Reply):
    phase: Phase
    report: PrepareReport


class RenewReply(_Reply):
    lease_expires_at: float


class RetireReply(_Reply):
    retired_count: int = Field(ge=0)


class ForgetReply(_Reply):
    forgotten_count: int = Field(ge=0)


class CommitReply(_Reply):
    phase: Literal["committed"]
    manifest: dict[str, Any]
    episode_ids: list[str]


class RestoreReply(_Reply):
    phase: Literal["restored"]
    source_checkpoint_id: str
    restored: list[str]


class ResumeReply(_Reply):
    phase: Literal["idle"]
    idempotent: bool
