"""The REINFORCE objective of the reference task.

For every rollout the policy (a causal LM) scores each completion token given the prompt and the
completion tokens before it. With ``A_r = reward_r - baseline`` — the batch's mean reward when the
batch holds more than one rollout, else 0 — the loss is

    loss = - mean_r( A_r * mean_t log p(completion_r[t] | prompt_r, completion_r[:t]) )

so rollouts above the batch average are made more likely and those below less likely, and a long
completion weighs no more than a short one. The whole batch is one forward pass: each rollout's
``prompt + completion[:-1]`` is a row, right-padded with an attention mask, and every position
that predicts a completion token carries that token as its target and its weight; the others
weigh 0. Nothing here draws random numbers, so the same weights and the same batch always give
the same loss and gradients on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.policy import Policy
from workers.trainer.job import TrainingJob


@dataclass(frozen=True)
class Batch:
    """A job's rollouts as padded rows: inputs, their mask, and per position the target and its weight."""

    inputs: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    rewards: torch.Tensor
    #: How many completion tokens the batch scores.
    tokens: int


def make_batch(job: TrainingJob, device: torch.device) -> Batch:
    """``job`` as a :class:`Batch` on ``device`` (see the module docs for the weights)."""
    rewards = torch.tensor([r.reward for r in job.rollouts], dtype=torch.float64)
    baseline = rewards.mean() if len(job.rollouts) > 1 else torch.tensor(0.0, dtype=torch.float64)
    advantages = rewards - baseline
    width = max(len(r.prompt) + len(r.completion) - 1 for r in job.rollouts)
    rows = len(job.rollouts)
    inputs = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    weights = torch.zeros(rows, width, dtype=torch.float32)
    for row, (rollout, advantage) in enumerate(zip(job.rollouts, advantages.tolist())):
        sequence = [*rollout.prompt, *rollout.completion]
        length = len(sequence) - 1
        inputs[row, :length] = torch.tensor(sequence[:-1])
        mask[row, :length] = 1
        # Position p predicts sequence[p + 1]; the completion starts at len(prompt).
        first = len(rollout.prompt) - 1
        targets[row, first:length] = torch.tensor(rollout.completion)
        weights[row, first:length] = advantage / (len(rollout.completion) * rows)
    return Batch(inputs=inputs.to(device), attention_mask=mask.to(device), targets=targets.to(device),
                 weights=weights.to(device), rewards=rewards.to(torch.float32),
                 tokens=sum(len(r.completion) for r in job.rollouts))


def reinforce_loss(model: Policy, batch: Batch) -> torch.Tensor:
    """The scalar loss of ``batch`` under ``model`` (see the module docs)."""
    log_probs = torch.log_softmax(model(batch.inputs, batch.attention_mask).float(), dim=-1)
    chosen = log_probs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    loss: torch.Tensor = -(batch.weights * chosen).sum()
    return loss


__all__ = ["Batch", "make_batch", "reinforce_loss"]
