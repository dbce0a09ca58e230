"""The participant side of the checkpoint protocol: a kit any aiohttp rollout server mounts.

Public API:

- :class:`~.control.ControlPlane` — the phase machine (one per server);
- :func:`~.routes.mount` and :class:`~.routes.CheckpointSettings` — the routes and their settings;
- :class:`~.base.Participant` — the hooks a server implements (or one of the four kinds in
  :mod:`workers.participant.kinds`);
- :class:`~.steps.EpisodeSteps` — step boundaries, parking, restarts and retire for episodes;
- :class:`~.marks.RetiredMarks` — durable retire marks;
- :mod:`.storage` — the records file and manifest.

See ``docs/participants.md`` for how to make a server a participant.
"""

from .base import ExportRecord, Participant
from .control import ControlPlane
from .marks import RetiredMarks
from .routes import CheckpointSettings, mount
from .steps import EpisodeSteps, StepMode

__all__ = ["CheckpointSettings", "ControlPlane", "EpisodeSteps", "ExportRecord", "Participant", "RetiredMarks",
           "StepMode", "mount"]
