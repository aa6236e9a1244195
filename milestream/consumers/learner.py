"""One training step on a batch of groups, whatever the backend: the trainer's arithmetic, free of Kafka.

    advantages  trainer.advantage_estimator over the whole batch (consumers/estimators.py)
    loss        make_loss(trainer) per prompt of each group, divided by the batch's token count
    step        the backend's (local, FSDP2 or Megatron-core): backward, clip, AdamW

The trainer runs it on every rank; ``milestream replay --step N`` runs it on the logged batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from milestream.config import Config
from milestream.consumers.backends import TrainBackend, make_backend
from milestream.consumers.estimators import AdvantageInputs, advantage_options, compute_advantages
from milestream.consumers.logprobs import pad
from milestream.consumers.losses import LossInput, make_loss
from milestream.schemas.records import GroupSample


@dataclass(frozen=True)
class CollectedGroup:
    group_id: str
    samples: list[GroupSample]
    staleness: int


@dataclass(frozen=True)
class PromptRows:
    """The samples of one group that share a prompt, with their advantages: one microbatch."""

    prompt_ids: list[int]
    samples: list[GroupSample]
    advantages: torch.Tensor  # [len(samples), longest response]


class Learner:
    def __init__(self, cfg: Config, backend: TrainBackend | None = None):
        self.cfg = cfg
        self.backend = backend or make_backend(cfg)
        self.loss = make_loss(cfg.trainer)

    def train_step(self, batch: Sequence[CollectedGroup]) -> dict[str, float]:
        """One optimizer step over the batch; the step's figures (loss and grad norm first)."""
        samples = [s for g in batch for s in g.samples]
        total_tokens = max(sum(sum(s.loss_mask) for s in samples), 1)
        microbatches = self._microbatches(batch)

        def loss_fn(rows: PromptRows) -> tuple[torch.Tensor, dict[str, float]]:
            logp = self.backend.logprobs(rows.prompt_ids, [s.response_ids for s in rows.samples],
                                         self.cfg.rollout.temperature)
            mask = pad([s.loss_mask for s in rows.samples]).to(logp.device)
            rollout_logp = pad([s.logprobs for s in rows.samples]).to(logp.device)
            advantages = rows.advantages[:, :mask.shape[1]].to(logp.device)
            out = self.loss(LossInput(logp, logp.detach(), rollout_logp, advantages, mask))  # one step: pi_old = pi
            return out.loss_sum / total_tokens, {**out.figures, "tokens": float(out.tokens)}

        result = self.backend.step(microbatches, loss_fn, self.cfg.trainer.max_grad_norm)
        figures = dict(result.figures)
        tokens = max(figures.pop("tokens"), 1.0)
        rewards = [s.reward for s in samples]
        return {
            "loss": result.loss, "grad_norm": result.grad_norm, "reward_mean": sum(rewards) / len(rewards),
            **{name: total / tokens for name, total in figures.items()},  # the loss's figures, per token
            "response_len_mean": tokens / len(samples), "samples": float(len(samples)),
        }

    def _microbatches(self, batch: Sequence[CollectedGroup]) -> list[PromptRows]:
        """Advantages over the whole batch (some estimators whiten across it), cut per group and prompt."""
        samples = [s for g in batch for s in g.samples]
        sizes = [len(g.samples) for g in batch]
        inputs = AdvantageInputs(torch.tensor([s.reward for s in samples]),
                                 torch.arange(len(batch)).repeat_interleave(torch.tensor(sizes)),
                                 pad([s.loss_mask for s in samples]))
        advantages = compute_advantages(self.cfg.trainer.advantage_estimator, inputs,
                                        advantage_options(self.cfg.trainer)).advantages
        microbatches = []
        for group, group_advantages in zip(batch, advantages.split(sizes)):
            index = {id(s): i for i, s in enumerate(group.samples)}
            for prompt_ids, rows in by_prompt(group.samples):  # one group shares one prompt; multi-turn may not
                microbatches.append(PromptRows(prompt_ids, rows, group_advantages[[index[id(s)] for s in rows]]))
        return microbatches

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.export_weights()

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.backend.load_state_dict(state)


def by_prompt(samples: Sequence[GroupSample]) -> list[tuple[list[int], list[GroupSample]]]:
    rows: dict[tuple[int, ...], list[GroupSample]] = {}
    for sample in samples:
        rows.setdefault(tuple(sample.prompt_ids), []).append(sample)
    return [(list(prompt), group) for prompt, group in rows.items()]
