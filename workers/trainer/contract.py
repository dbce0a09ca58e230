"""The trainer contract: what the orchestrator calls on a trainer class, and what it relies on.

``training.trainer.class`` names any class with these methods; each rank of the executor is built
as ``Class(**kwargs)`` with the configuration's keyword arguments (``state_dir`` among them when the
configuration gives one). Every argument and every reply is plain data (JSON-like dicts, lists,
strings, numbers), since executors carry them across processes and Ray. Exceptions cross back
intact, so a trainer's typed errors reach the orchestrator as themselves.

The promises below are what exactly-once training and commit-gated publication rest on
(engine/workflows/training/controller.py and publication.py). The conformance kit
(:mod:`workers.trainer.conformance`) checks each of them against a class and names the one broken.
The reference :class:`workers.trainer.worker.Trainer` keeps them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

#: The methods the orchestrator calls, in the order this module documents them.
METHODS = ("train", "save_checkpoint", "verify_checkpoint", "load_checkpoint", "declare_initial",
           "prepare_weights", "send_weights", "health")


@runtime_checkable
class TrainerContract(Protocol):
    """A trainer rank (see the module docs)."""

    def train(self, job: Mapping[str, Any]) -> dict[str, Any]:
        """Take the job's optimizer step, exactly once; return its metrics (a JSON object).

        ``job`` is the job's payload with its ``job_id`` (the SHA-256 hex of its identity).
        - **Once.** A job this trainer already applied (its latest step, or the job of the checkpoint
          it loaded) is refused with an exception, and nothing moves.
        - **Malformed jobs** are refused before any step with ``workers.trainer.errors.JobError``
          (or a subclass): the orchestrator then records the job ``FAILED`` rather than ambiguous.
        - **Step record first.** With a ``state_dir``, the durable step record says ``started`` for
          the job (and the step it will become) *before* the optimizer moves, and ``applied``
          after: ``workers.trainer.steps.write_step_record``.
        """
        ...

    def save_checkpoint(self, path: str, job_id: str) -> dict[str, Any]:
        """Write model and optimizer state to ``path``, tagged with ``job_id`` and the step, creating
        missing parent directories (the trainer may run on another node than the orchestrator).

        ``job_id`` must be the job of the latest step: a checkpoint is the evidence that the job's
        step ran, so one naming another job (or written before any step) is refused.
        """
        ...

    def verify_checkpoint(self, path: str) -> dict[str, Any]:
        """``{"job_id": ..., "step": ..., "metrics": {...}?}`` (more keys allowed) of the checkpoint at
        ``path`` if it is whole; any exception otherwise. ``metrics``, when given, are the ones ``train``
        returned for that step: a job settled from the checkpoint after a crash records them. A truncated or altered checkpoint must not verify: the
        orchestrator settles an ambiguous job from a checkpoint that verifies and names it."""
        ...

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Verify ``path`` and continue from it: weights, optimizer, step and job. Training the next
        job after loading gives the weights the saving trainer would have. The step record says
        ``loaded`` with the checkpoint's job and step. Returns what :meth:`verify_checkpoint` does."""
        ...

    def declare_initial(self) -> dict[str, Any]:
        """Say durably that this trainer holds its initial weights (step record ``loaded``, step 0, job
        ``initial``). Refused by a trainer that took, loaded or began any step."""
        ...

    def prepare_weights(self, target: Mapping[str, Any]) -> dict[str, Any]:
        """Write the current weights as ``target["version"]`` into ``target["directory"]``, in the
        format the deployment's engines load (``update_weights_from_disk``); return at least
        ``{"version", "directory"}``."""
        ...

    def send_weights(self, target: Mapping[str, Any], receivers: Sequence[Any] = ()) -> dict[str, Any]:
        """Have each receiver load the directory :meth:`prepare_weights` wrote for ``target``; a target
        this trainer did not prepare is refused."""
        ...

    def health(self) -> dict[str, Any]:
        """A cheap report, callable at any time: ``step`` (optimizer steps in the weights),
        ``last_job_id`` (the job of the latest step, or None), ``in_doubt`` (a job whose step began and
        did not finish, or None) and ``step_record`` (the durable record as a dict, or None without a
        ``state_dir``). The orchestrator settles an ambiguous job from these.

        ``writes_checkpoint: False`` (absent: True) says the trainer writes no checkpoint per step: the
        orchestrator then never calls ``save_checkpoint``/``verify_checkpoint``/``load_checkpoint``,
        records the job ``CHECKPOINT`` with a null path, publishes the live weights, and puts the
        trainer back on the committed head with :meth:`load_weights` (see there)."""
        ...


class NoCheckpointTrainer(TrainerContract, Protocol):
    """A trainer whose health says ``writes_checkpoint: False`` also has this method."""

    def load_weights(self, directory: str, job_id: str, step: int) -> dict[str, Any]:
        """Load a published weights directory (what :meth:`prepare_weights` wrote for the committed
        head) and continue from it as the state after ``job_id``'s step ``step``: health then reports
        that step and job, the step record says ``loaded``, and that job is refused if sent again.
        Called when the trainer must be put back on the head: a fresh process after a restart, or
        after a rejected job. The optimizer's state is not in published weights: it starts afresh."""
        ...


__all__ = ["METHODS", "NoCheckpointTrainer", "TrainerContract"]
