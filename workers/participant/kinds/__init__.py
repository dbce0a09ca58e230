"""The participant kinds: one :class:`~workers.participant.base.Participant` subclass per server kind.

- :class:`PolicyModelParticipant` (``model``): held responses and a capture ledger.
- :class:`AgentParticipant` (``agent``): agent sessions, through session hooks or restart-only.
- :class:`ResourcesParticipant` (``resources``): sessions bound to episodes, ``restart_only`` by
  default, ``stateless`` or ``exported``.
- :class:`EnvironmentParticipant` (``environment``): episode steps, exported at their boundaries.

A server builds its kind, then ``ControlPlane(participant, state_dir=...)`` (which attaches the
retire marks and the readiness notifier to it) and mounts the routes with
:func:`workers.participant.routes.mount`.
"""

from .agent import RESTART_HEADER, AgentParticipant, AgentSession, RestoredSession, SessionHooks, restart_headers
from .environment import Episode, EnvironmentParticipant, RestoredEpisode, task_digest
from .model import ModelTicket, PolicyModelParticipant
from .resources import (VERIFY_HEADER, ResourcesMode, ResourcesParticipant, ResourcesRequest, SessionStateHooks,
                        VerifyMode, verify_headers, verify_mode_of)

__all__ = [
    "RESTART_HEADER", "VERIFY_HEADER", "AgentParticipant", "AgentSession", "EnvironmentParticipant", "Episode",
    "ModelTicket", "RestoredEpisode", "task_digest", "PolicyModelParticipant",
    "ResourcesMode", "ResourcesParticipant", "ResourcesRequest", "RestoredSession", "SessionHooks",
    "SessionStateHooks", "VerifyMode", "restart_headers", "verify_headers", "verify_mode_of",
]
