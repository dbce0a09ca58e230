"""The REINFORCE objective of the reference task.

For every rollout the policy scores each completion token given the token before it (the
last prompt token for the first one). With ``A_r = reward_r - baseline`` — the batch's
mean reward when the batch holds more than one rollout, else 0 — the loss is

    loss = - mean_r( A_r * mean_t log p(completion_r[t] | previous token) )

so rollouts above the batch average are made more likely and those below less likely,
and a long completion weighs no more than a short one. The whole batch is one forward
pass over concatenated tensors; nothing here draws random numbers, so the same weights and
the same batch always give the same loss and gradients on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.policy import Policy
from workers.trainer.job import TrainingJob


@dataclass(frozen=True)
class Batch:
    """A job's rollouts as flat tensors: inputs, targets and the weight of each target token."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    rewards: torch.Tensor


def make_batch(job: TrainingJob, device: torch.device) -> Batch:
    """Flatten ``job`` into a :class:`Batch` on ``device`` (see the module docs for the weights)."""
    rewards = torch.tensor([r.reward for r in job.rollouts], dtype=torch.float64)
    baseline = rewards.mean() if len(job.rollouts) > 1 else torch.tensor(0.0, dtype=torch.float64)
    advantages = rewards - baseline
    inputs: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    for rollout, advantage in zip(job.rollouts, advantages.tolist()):
        previous = [rollout.prompt[-1], *rollout.completion[:-1]]
        inputs.extend(previous)
        targets.extend(rollout.completion)
        per_token = advantage / (len(rollout.completion) * len(job.rollouts))
        weights.extend([per_token] * len(rollout.completion))
    return Batch(
        inputs=torch.tensor(inputs, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        weights=torch.tensor(weights, dtype=torch.float32, device=device),
        rewards=rewards.to(torch.float32),
    )


def reinforce_loss(model: Policy, batch: Batch) -> torch.Tensor:
    """The scalar loss of ``batch`` under ``model`` (see the module docs)."""
    log_probs = torch.log_softmax(model(batch.inputs), dim=-1)
    chosen = log_probs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    loss: torch.Tensor = -(batch.weights * chosen).sum()
    return loss


__all__ = ["Batch", "make_batch", "reinforce_loss"]
