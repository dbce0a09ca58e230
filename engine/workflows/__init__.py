"""One folder per workflow family, each holding its controllers and, beside them, its HTTP routes
(``api``), CLI commands (``cli``) and its registration (``workflow``): ``discovery``, ``checkpoint``
(checkpoint, restore, retire and forget), ``training`` (jobs and commit-gated publication),
``deployment`` (the service stack).

Importing this package registers the four, in this order (:mod:`engine.runtime.workflow`); the
service and the CLI import it. A new family is one more folder with a ``workflow`` module (and its
migration), imported here or named in the config's ``workflows:``."""

from engine.workflows.discovery import workflow as discovery_workflow
from engine.workflows.checkpoint import workflow as checkpoint_workflow
from engine.workflows.training import workflow as training_workflow
from engine.workflows.deployment import workflow as deployment_workflow

#: The built-in families, in the order they are registered.
BUILTIN = (discovery_workflow.WORKFLOW, checkpoint_workflow.WORKFLOW, training_workflow.WORKFLOW,
           deployment_workflow.WORKFLOW)

__all__ = ["BUILTIN", "checkpoint", "deployment", "discovery", "training"]
