"""The trainer worker: one optimizer step per job on the reference :class:`~workers.policy.Policy`.

Executors construct it from ``WorkerSpec(worker_cls="workers.trainer.worker:Trainer",
kwargs={...})``, so the constructor takes only plain, picklable arguments. Methods:

- :meth:`Trainer.train` — validate the job, take exactly one Adam step with the REINFORCE
  loss (:mod:`workers.trainer.objective`), return metrics. A job already applied (the last
  trained job, or the job of the loaded checkpoint) is refused rather than applied twice.
- :meth:`Trainer.save_checkpoint` / :meth:`Trainer.load_checkpoint` /
  :meth:`Trainer.verify_checkpoint` — model and optimizer state with job id and step, in one
  atomically written, digest-checked file (:mod:`workers.trainer.checkpoint`). Loading a
  checkpoint and training the next job gives bitwise the weights the saving trainer gets.
- :meth:`Trainer.prepare_weights` / :meth:`Trainer.send_weights` — write a weight version to
  a directory, then have receivers load it (:mod:`workers.trainer.transfer`).
- :meth:`Trainer.health` and :meth:`Trainer.weights_digest`.

With a ``state_dir`` the trainer keeps a durable step record (:mod:`workers.trainer.steps`)
around every step and load, so an orchestrator can tell whether a job's step ever started.

Determinism: the policy is initialised from ``seed`` alone, the loss draws no random
numbers, and each step runs with ``torch.use_deterministic_algorithms(True)`` (restored
afterwards, since the flag is process-wide). On the CPU two trainers built with the same
arguments and given the same jobs hold bitwise-identical weights. On CUDA the flag is set in
warn-only mode, because some CUDA kernels need environment settings the trainer cannot
impose on the rank; results there are close, not guaranteed identical.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from workers.policy import DIM, VOCAB, Policy
from workers.trainer.checkpoint import read_checkpoint, verify_checkpoint, write_checkpoint
from workers.trainer.errors import CheckpointError, TrainerStateError
from workers.trainer.job import TrainingJob, parse_job
from workers.trainer.objective import make_batch, reinforce_loss
from workers.trainer.steps import INITIAL, read_step_record, write_step_record
from workers.trainer.transfer import Receiver, WeightsTarget, prepare, send


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{name}: {value!r} must be a finite number > 0")
    return float(value)


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device: {device!r} is not a torch device string") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} asks for CUDA, which this process does not have")
    return resolved


@contextmanager
def _deterministic(device: torch.device) -> Iterator[None]:
    # The flag is global to the process; restore it so a rank shared with other code
    # (the uni executor runs workers in the caller's process) is left as it was.
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)


class Trainer:
    """A trainer rank (see the module docs). Every argument is plain data, for spawn and Ray.

    ``seed`` fixes the initial weights; ``lr`` is Adam's learning rate; ``max_grad_norm``
    clips the gradient; ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``None`` (CUDA when
    present); ``state_dir`` enables the step record; ``vocab``/``dim`` size the policy.
    """

    def __init__(self, *, seed: int = 0, lr: float = 0.05, max_grad_norm: float = 1.0,
                 device: str | None = None, state_dir: str | None = None,
                 vocab: int = VOCAB, dim: int = DIM) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: {seed!r} must be an int >= 0")
        for name, size in (("vocab", vocab), ("dim", dim)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}: {size!r} must be an int >= 1")
        self._config: dict[str, Any] = {
            "seed": seed, "lr": _positive("lr", lr),
            "max_grad_norm": _positive("max_grad_norm", max_grad_norm), "vocab": vocab, "dim": dim}
        self.device = _resolve_device(device)
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self.model = Policy(vocab, dim, seed=seed).to(self.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self._config["lr"])
        self.step = 0
        self.last_job_id: str | None = None
        #: ``train``'s reply for the latest step, kept in its checkpoint (evidence with its metrics).
        self.last_metrics: dict[str, Any] = {}
        self.prepared: WeightsTarget | None = None
        #: The job whose step began and did not finish (it raised part-way): the weights may hold
        #: part of it. Cleared by a finished step or a loaded checkpoint.
        self.in_doubt: str | None = None

    # -- training ---------------------------------------------------------------------

    def train(self, job: TrainingJob | Mapping[str, Any]) -> dict[str, Any]:
        """One optimizer step over ``job``'s rollouts; returns the step's metrics.

        Raises :class:`~workers.trainer.errors.JobError` for a malformed job (nothing is
        written then) and :class:`TrainerStateError` for a job this trainer already applied.
        """
        parsed = parse_job(job, self._config["vocab"])
        if parsed.job_id == self.last_job_id:
            # The orchestrator never replays a RUNNING job; this guard makes a bug there
            # fail loudly instead of applying the same batch twice.
            raise TrainerStateError(f"job {parsed.job_id!r} was already applied at step {self.step}")
        batch = make_batch(parsed, self.device)
        if self._state_dir is not None:
            write_step_record(self._state_dir, self.step + 1, parsed.job_id, "started")
        self.model.train()
        self.in_doubt = parsed.job_id
        with _deterministic(self.device):
            self.optimizer.zero_grad(set_to_none=True)
            loss = reinforce_loss(self.model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       self._config["max_grad_norm"])
            self.optimizer.step()
        self.step += 1
        self.last_job_id = parsed.job_id
        self.in_doubt = None
        if self._state_dir is not None:
            write_step_record(self._state_dir, self.step, parsed.job_id, "applied")
        self.last_metrics = {
            "job_id": parsed.job_id,
            "step": self.step,
            "loss": float(loss.item()),
            "grad_norm": float(grad_norm.item()),
            "reward_mean": float(batch.rewards.mean().item()),
            "rollouts": len(parsed.rollouts),
            "tokens": batch.tokens,
        }
        return dict(self.last_metrics)

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self, path: str, job_id: str) -> dict[str, Any]:
        """Write model and optimizer state tagged with ``job_id`` and the step to ``path``.

        ``job_id`` must be the job of the trainer's latest step: a checkpoint is the evidence
        that a job's step ran, so it cannot name another job or a step never taken.
        """
        if self.last_job_id is None:
            raise TrainerStateError(f"no optimizer step has been taken; a checkpoint tagged "
                                    f"{job_id!r} would claim a step that never ran")
        if job_id != self.last_job_id:
            raise TrainerStateError(f"job_id {job_id!r} is not the job of step {self.step} "
                                    f"({self.last_job_id!r})")
        info = write_checkpoint(path, job_id=job_id, step=self.step, model=self.model.state_dict(),
                                optimizer=self.optimizer.state_dict(), config=self._config,
                                metrics=self.last_metrics)
        return info.as_dict()

    def verify_checkpoint(self, path: str) -> dict[str, Any]:
        """The info of the checkpoint at ``path`` if it verifies; else :class:`CheckpointError`."""
        return verify_checkpoint(path).as_dict()

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Verify ``path`` and restore model, optimizer, step and job id from it."""
        info, state = read_checkpoint(path)
        saved = state.get("config", {})
        for key in ("vocab", "dim"):
            if saved.get(key) != self._config[key]:
                raise CheckpointError(path, f"{key} {saved.get(key)!r} does not match this "
                                            f"trainer's {self._config[key]!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = info.step
        self.last_job_id = info.job_id
        self.last_metrics = dict(info.metrics)
        self.in_doubt = None
        if self._state_dir is not None:
            write_step_record(self._state_dir, info.step, info.job_id, "loaded")
        return info.as_dict()

    def declare_initial(self) -> dict[str, Any]:
        """Say durably that this trainer holds its initial weights: no job's step is in them.

        Only a trainer at step 0 that never loaded a checkpoint and never began a step may say
        so. The step record becomes ``loaded`` at step 0 for job ``initial`` (no job id is
        ``initial``: ids are SHA-256 hex), so a record a dead trainer process left behind, naming a job whose step
        died with that process's memory, no longer reads as that job's step being held here.
        """
        if self.step != 0 or self.last_job_id is not None or self.in_doubt is not None:
            doubt = f", and job {self.in_doubt!r}'s step began and did not finish" if self.in_doubt else ""
            raise TrainerStateError(f"this trainer is at step {self.step} (job {self.last_job_id!r}){doubt}: "
                                    f"its weights are not the initial ones")
        record = None
        if self._state_dir is not None:
            record = write_step_record(self._state_dir, 0, INITIAL, "loaded")
        return {"step": 0, "job_id": None, "step_record": record.as_dict() if record else None}

    # -- weights ----------------------------------------------------------------------

    def prepare_weights(self, target: WeightsTarget | Mapping[str, Any]) -> dict[str, Any]:
        """Write the current weights as ``target``'s version into its directory."""
        parsed = WeightsTarget.parse(target)
        digest = prepare(self.model, parsed)
        self.prepared = parsed
        return {"version": parsed.version, "directory": parsed.directory, "sha256": digest,
                "step": self.step}

    def send_weights(self, target: WeightsTarget | Mapping[str, Any],
                     receivers: Sequence[Receiver] = ()) -> dict[str, Any]:
        """Have each receiver load ``target``'s prepared directory; see :mod:`workers.trainer.transfer`."""
        parsed = WeightsTarget.parse(target)
        if self.prepared != parsed:
            raise TrainerStateError(f"weights {parsed.version!r} in {parsed.directory} were not "
                                    f"prepared by this trainer; call prepare_weights first")
        count = send(parsed, receivers)
        return {"version": parsed.version, "directory": parsed.directory, "receivers": count}

    # -- introspection ----------------------------------------------------------------

    def weights_digest(self) -> str:
        """SHA-256 over the model's tensors in name order; equal digests mean bitwise-equal weights."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            # A fresh clone owns a storage of exactly its own bytes (a view's storage may be larger).
            flat = tensor.detach().to("cpu").contiguous().clone()
            digest.update(f"{name}:{flat.dtype}:{tuple(flat.shape)}".encode())
            digest.update(bytes(flat.untyped_storage()))
        return digest.hexdigest()

    def health(self) -> dict[str, Any]:
        """A cheap liveness report: device, step, last job, prepared version, step record."""
        record = read_step_record(self._state_dir) if self._state_dir is not None else None
        return {
            "ok": True,
            "pid": os.getpid(),
            "device": str(self.device),
            "step": self.step,
            "last_job_id": self.last_job_id,
            "in_doubt": self.in_doubt,
            "prepared_version": self.prepared.version if self.prepared else None,
            "step_record": record.as_dict() if record else None,
        }


__all__ = ["Trainer"]
