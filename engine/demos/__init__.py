"""``tidelog demo`` (``checkpoint``: a checkpoint mid-episode, SIGKILL, restore) and ``tidelog
demo-train`` (``training``: an RL loop through crashes); their options in ``arguments``."""

__all__ = ["arguments", "checkpoint", "training"]
