"""One loss interface: ``Loss(LossInput) -> LossOutput``, with policy, value, supervised and user variants.

Three policies meet in a batch: pi_rollout sampled it (the engine's log-probs), pi_old is the
trainer's policy before this step (one optimizer step per batch: the current one, detached), pi
the one being trained. The policy loss is PPO-clip on pi/pi_old (GSPO: on the geometric mean of
the ratios over the response), times the rollout-training correction on pi_old/pi_rollout:

  tis          truncated importance sampling: weight clamped to ``interval`` (default [0, 2])
  clip_or_pop  masked importance sampling (IcePop): the weight inside ``interval``, tokens outside
               it popped (zero loss); they stay in the caller's token count
  none         weight 1

Every loss returns ``loss_sum`` summed over the masked tokens (the caller divides by the token
count of the whole batch, so that groups of any size weigh by their tokens) and figures that are
sums too, each named for the per-token mean it gives once divided by the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from milestream.config import TrainerConfig, import_path
from milestream.train.tensor_ops import masked_mean

Correction = Literal["tis", "clip_or_pop", "none"]


@dataclass(frozen=True)
class LossInput:
    logp: Tensor  # [B, T] log pi of the response tokens, with gradient
    old_logp: Tensor  # [B, T] log pi_old, without gradient
    rollout_logp: Tensor  # [B, T] log pi_rollout, as the engine sampled
    advantages: Tensor  # [B, T]
    mask: Tensor  # [B, T] 1 on the tokens the loss sees
    returns: Tensor | None = None  # [B, T] value targets (ppo)
    values: Tensor | None = None  # [B, T] V of the value head, with gradient (ppo)
    old_values: Tensor | None = None  # [B, T] V before this step (ppo)


@dataclass(frozen=True)
class LossOutput:
    loss_sum: Tensor  # summed over the masked tokens
    tokens: int  # masked tokens in this input
    figures: dict[str, float]  # sums over the masked tokens; / tokens gives what the name says


class Loss(Protocol):
    def __call__(self, batch: LossInput) -> LossOutput: ...


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, kind: Correction,
                       interval: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """(the weight on each token's loss, the tokens it clipped or popped) from pi_old/pi_rollout."""
    raw = torch.exp(old_logp - rollout_logp)
    low, high = interval
    outside = (raw < low) | (raw > high)
    if kind == "tis":
        return raw.clamp(low, high), outside
    if kind == "clip_or_pop":
        return raw.masked_fill(outside, 0.0), outside
    if kind == "none":
        return torch.ones_like(raw), torch.zeros_like(outside)
    raise ValueError(f"unknown rollout correction {kind!r}")


def mismatch_figures(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far pi_rollout is from pi_old, summed over the masked tokens.

    With log w = log pi_old - log pi_rollout on tokens sampled from pi_rollout, KL(pi_rollout || pi_old)
    is estimated by k1 = -log w and by k3 = w - 1 - log w (unbiased too, never negative, lower variance).
    """
    log_weight = (old_logp - rollout_logp).detach()
    return {
        "logprob_diff": float((log_weight.abs() * mask).sum()),
        "kl_rollout_train": float((-log_weight * mask).sum()),
        "kl_rollout_train_k3": float(((log_weight.exp() - 1 - log_weight) * mask).sum()),
    }


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: GSPO's log s_i = mean over the response of log pi/pi_old, on every token of the row."""
    return masked_mean(logp - old_logp, mask, dim=-1).view(-1, 1).expand_as(logp)


@dataclass(frozen=True)
class PolicyLoss:
    """-min(r A, clip(r, 1 - eps, 1 + eps) A) * correction weight, per token."""

    clip_eps: float = 0.2
    correction: Correction = "tis"
    interval: tuple[float, float] = (0.0, 2.0)
    sequence_ratio: bool = False  # GSPO: r is the sequence's ratio, clipped as a whole

    def __call__(self, batch: LossInput) -> LossOutput:
        mask = batch.mask.to(batch.logp.dtype)
        if self.sequence_ratio:
            ratio = torch.exp(sequence_log_ratio(batch.logp, batch.old_logp, mask))
        else:
            ratio = torch.exp(batch.logp - batch.old_logp)
        unclipped = -batch.advantages * ratio
        clipped = -batch.advantages * ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps)
        weight, corrected = rollout_correction(batch.old_logp, batch.rollout_logp, self.correction, self.interval)
        per_token = torch.maximum(unclipped, clipped) * weight
        active = mask.bool()
        with torch.no_grad():
            figures = {
                "ratio_mean": float((ratio * mask).sum()),
                "ppo_clip_frac": float((clipped > unclipped)[active].sum()),
                "is_weight_mean": float((weight * mask).sum()),
                "is_corrected_frac": float(corrected[active].sum()),
                **mismatch_figures(batch.old_logp, batch.rollout_logp, mask),
            }
        return LossOutput((per_token * mask).sum(), int(mask.sum()), figures)


@dataclass(frozen=True)
class ValueLoss:
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2), per token."""

    clip: float = 0.2

    def __call__(self, batch: LossInput) -> LossOutput:
        if batch.values is None or batch.old_values is None or batch.returns is None:
            raise ValueError("the value loss needs values, old_values and returns")
        mask = batch.mask.to(batch.values.dtype)
        clipped_values = batch.old_values + (batch.values - batch.old_values).clamp(-self.clip, self.clip)
        unclipped = (batch.values - batch.returns) ** 2
        clipped = (clipped_values - batch.returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        loss_sum = (per_token * mask).sum()
        figures = {"value_loss": loss_sum.item(), "value_clip_frac": float((clipped > unclipped)[mask.bool()].sum())}
        return LossOutput(loss_sum, int(mask.sum()), figures)


@dataclass(frozen=True)
class ActorCriticLoss:
    """PPO with a learned value function: policy loss + value_coef * value loss."""

    policy: PolicyLoss
    value: ValueLoss
    value_coef: float

    def __call__(self, batch: LossInput) -> LossOutput:
        policy, value = self.policy(batch), self.value(batch)
        return LossOutput(policy.loss_sum + self.value_coef * value.loss_sum, policy.tokens,
                          {**policy.figures, **value.figures})


def supervised_loss(batch: LossInput) -> LossOutput:
    """Negative log-likelihood of the masked tokens (SFT): -sum log pi."""
    mask = batch.mask.to(batch.logp.dtype)
    loss_sum = -(batch.logp * mask).sum()
    return LossOutput(loss_sum, int(mask.sum()), {"nll_mean": loss_sum.item()})


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state of each token: [B, T, hidden] -> [B, T]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.proj(hidden_states).squeeze(-1)


def make_loss(cfg: TrainerConfig) -> Loss:
    """The loss ``cfg`` names: a user loss (``cfg.loss``), supervised NLL, or the policy loss of its estimator."""
    if cfg.loss:
        return import_path(cfg.loss, "trainer.loss")
    if cfg.objective == "supervised":
        return supervised_loss
    policy = PolicyLoss(cfg.clip_eps, cfg.correction, cfg.tis_interval,
                        sequence_ratio=cfg.advantage_estimator == "gspo")
    if cfg.advantage_estimator == "ppo":
        return ActorCriticLoss(policy, ValueLoss(cfg.value_clip), cfg.value_coef)
    return policy
