"""One folder per workflow family, each holding its controllers and, beside them, its HTTP routes
(``api``) and CLI commands (``cli``): ``discovery``, ``checkpoint`` (checkpoint, restore, retire
and forget), ``training`` (jobs and commit-gated publication)."""

__all__ = ["checkpoint", "discovery", "training"]
