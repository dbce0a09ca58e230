"""Trainer classes defined only in the tests, selected by import path (docs/training.md, "Bring your
own trainer").

``SgdTrainer`` keeps the trainer contract (workers/trainer/contract.py) with code of its own: plain
SGD on the reference policy's weights (so the reference engine can serve what it publishes), its own
checkpoint format (a torch file beside a JSON sidecar holding the file's SHA-256, job and step) and
the step record of ``workers.trainer.steps``. ``NoCheckpointSgdTrainer`` writes no checkpoint (its
health says ``writes_checkpoint`` false) and is put back on published weights by ``load_weights``.
The four ``Broken*`` classes each break one promise on purpose, for the conformance kit to name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from workers.policy import Policy, load_weights, save_weights
from workers.trainer.errors import JobError
from workers.trainer.steps import INITIAL, read_step_record, write_step_record


class SgdTrainer:
    """One SGD step per job: the mean reward-weighted log-likelihood of each rollout's completion."""

    def __init__(self, *, lr: float = 0.1, seed: int = 0, state_dir: str | None = None) -> None:
        self.model = Policy(seed=seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.state_dir = Path(state_dir) if state_dir else None
        self.step = 0
        self.last_job_id: str | None = None
        self.in_doubt: str | None = None
        self.prepared: tuple[str, str] | None = None

    def _record(self, step: int, job_id: str, phase: str) -> None:
        if self.state_dir is not None:
            write_step_record(self.state_dir, step, job_id, phase)  # type: ignore[arg-type]

    def train(self, job: Mapping[str, Any]) -> dict[str, Any]:
        rollouts = job.get("rollouts")
        if not isinstance(rollouts, list) or not rollouts:
            raise JobError("rollouts", rollouts, "must be a non-empty list")
        job_id = str(job["job_id"])
        if job_id == self.last_job_id:
            raise RuntimeError(f"job {job_id} was already applied at step {self.step}")
        self._record(self.step + 1, job_id, "started")
        self.in_doubt = job_id
        self.optimizer.zero_grad()
        loss = torch.zeros(())
        for r in rollouts:
            tokens = torch.tensor([0, *r["completion"]])
            logits = self.model(tokens[:-1].unsqueeze(0))[0]
            logp = torch.log_softmax(logits, -1).gather(1, tokens[1:].unsqueeze(1)).sum()
            loss = loss - float(r["reward"]) * logp / len(rollouts)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.step += 1
        self.last_job_id, self.in_doubt = job_id, None
        self._record(self.step, job_id, "applied")
        return {"loss": float(loss.detach()), "step": self.step, "optimizer": "sgd"}

    def save_checkpoint(self, path: str, job_id: str) -> dict[str, Any]:
        if job_id != self.last_job_id or self.last_job_id is None:
            raise RuntimeError(f"job {job_id!r} is not the latest step's ({self.last_job_id!r})")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, path)
        info = {"job_id": job_id, "step": self.step, "sha256": _digest(path)}
        Path(path + ".json").write_text(json.dumps(info))
        return info

    def verify_checkpoint(self, path: str) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(Path(path + ".json").read_text())
        if _digest(path) != info["sha256"]:
            raise ValueError(f"{path}: its SHA-256 is not the one recorded beside it")
        return info

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        info = self.verify_checkpoint(path)
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.last_job_id, self.in_doubt = info["step"], info["job_id"], None
        self._record(self.step, info["job_id"], "loaded")
        return info

    def declare_initial(self) -> dict[str, Any]:
        if self.step or self.last_job_id or self.in_doubt:
            raise RuntimeError(f"at step {self.step}: not the initial weights")
        self._record(0, INITIAL, "loaded")
        return {"step": 0, "job_id": None}

    def prepare_weights(self, target: Mapping[str, Any]) -> dict[str, Any]:
        save_weights(self.model, target["directory"], target["version"])
        self.prepared = (target["version"], target["directory"])
        return {"version": target["version"], "directory": target["directory"], "step": self.step}

    def send_weights(self, target: Mapping[str, Any], receivers: Sequence[Any] = ()) -> dict[str, Any]:
        if self.prepared != (target["version"], target["directory"]):
            raise RuntimeError(f"{target['version']!r} was not prepared here")
        for receiver in receivers:
            receiver(target["directory"])
        return {"version": target["version"], "receivers": len(receivers)}

    def health(self) -> dict[str, Any]:
        record = read_step_record(self.state_dir) if self.state_dir is not None else None
        return {"ok": True, "pid": os.getpid(), "step": self.step, "last_job_id": self.last_job_id,
                "in_doubt": self.in_doubt, "step_record": record.as_dict() if record else None}


class NoCheckpointSgdTrainer(SgdTrainer):
    """``SgdTrainer`` that writes no checkpoint per step (health says ``writes_checkpoint`` false): its
    live weights are published, and it is put back on the committed head by ``load_weights``. Plain
    SGD keeps no optimizer state, so a trainer put back on published weights steps exactly as the one
    that published them would have."""

    def save_checkpoint(self, path: str, job_id: str) -> dict[str, Any]:
        raise RuntimeError("this trainer writes no checkpoint (its health says writes_checkpoint false)")

    def verify_checkpoint(self, path: str) -> dict[str, Any]:
        raise RuntimeError("this trainer writes no checkpoint")

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        raise RuntimeError("this trainer writes no checkpoint")

    def load_weights(self, directory: str, job_id: str, step: int) -> dict[str, Any]:
        state, meta = load_weights(directory)
        self.model.load_state_dict(state)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.optimizer.param_groups[0]["lr"])
        self.step, self.last_job_id, self.in_doubt = step, job_id, None
        self._record(step, job_id, "loaded")
        return {"job_id": job_id, "step": step, "version": meta.get("version")}

    def health(self) -> dict[str, Any]:
        return {**super().health(), "writes_checkpoint": False}


class BrokenForgetfulLoad(NoCheckpointSgdTrainer):
    """Loads published weights but forgets which job they hold: that job trains again."""

    def load_weights(self, directory: str, job_id: str, step: int) -> dict[str, Any]:
        info = super().load_weights(directory, job_id, step)
        self.last_job_id = None
        return info

    def health(self) -> dict[str, Any]:
        # Says the job it was given, as promised, while train no longer refuses it.
        report = super().health()
        record = report.get("step_record") or {}
        return {**report, "last_job_id": record.get("job_id") if record.get("phase") == "loaded" else
                report["last_job_id"]}


def _digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class BrokenTrainsTwice(SgdTrainer):
    """Forgets which job it applied: the same job trains again."""

    def train(self, job: Mapping[str, Any]) -> dict[str, Any]:
        self.last_job_id = None
        return super().train(job)


class BrokenLateRecord(SgdTrainer):
    """Writes ``started`` only after the optimizer moved."""

    def train(self, job: Mapping[str, Any]) -> dict[str, Any]:
        state, self.state_dir = self.state_dir, None
        try:
            metrics = super().train(job)
        finally:
            self.state_dir = state
        self._record(self.step, str(job["job_id"]), "started")
        self._record(self.step, str(job["job_id"]), "applied")
        return metrics


class BrokenTrustingVerify(SgdTrainer):
    """Believes the sidecar without reading the checkpoint: a truncated file verifies."""

    def verify_checkpoint(self, path: str) -> dict[str, Any]:
        info: dict[str, Any] = json.loads(Path(path + ".json").read_text())
        return info



class RefusingTrainer(SgdTrainer):
    """Refuses every job as malformed: a rank that disagrees with the others about a job."""

    def train(self, job: Mapping[str, Any]) -> dict[str, Any]:
        raise JobError("rollouts", "(any)", "this rank refuses every job")
