"""Wire models shared by the orchestrator and the participants.

This is the one module both sides import. It follows the partial-rollout
checkpoint protocol (routes under ``/ng-control/v1/checkpoint/``); the models
here cover what discovery reads. Request models forbid unknown fields; replies
allow the extras a participant adds to them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CONTROL_PREFIX = "/ng-control/v1/checkpoint"
STATUS_PATH = f"{CONTROL_PREFIX}/status"

#: Participant kinds in prepare order (callers before callees).
KINDS: tuple[str, ...] = ("environment", "model", "agent", "resources")
Kind = Literal["environment", "model", "agent", "resources"]
PHASES: tuple[str, ...] = ("idle", "preparing", "prepared", "committed", "restored")
Phase = Literal["idle", "preparing", "prepared", "committed", "restored"]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    detail: str


class ErrorBody(BaseModel):
    """``{"error": {"code": ..., "detail": ...}}`` — every typed error on the wire."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class PrepareReport(BaseModel):
    model_config = ConfigDict(extra="allow")
    ready: bool
    blockers: list[str] = Field(default_factory=list)
    blocker_count: int = Field(default=0, ge=0)
    counts: dict[str, int] = Field(default_factory=dict)
    restarts: list[str] = Field(default_factory=list)


class StatusReply(BaseModel):
    """``GET status``: who the participant is and where it stands."""

    model_config = ConfigDict(extra="allow")
    kind: str
    instance: str = Field(min_length=1, max_length=255)
    phase: Phase
    checkpoint_id: str | None = None
    lease_expires_at: float | None = None
    retired_rollouts: int = Field(default=0, ge=0)
    report: PrepareReport | None = None
