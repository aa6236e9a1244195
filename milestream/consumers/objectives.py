"""Advantages, the clipped policy loss and the rollout-training correction, on plain tensors.

The correction is Miles' truncated importance sampling: the engine sampled from pi_rollout, the
trainer's policy is pi_train, and each token's loss is weighted by pi_train_old / pi_rollout
clamped to ``tis_interval`` (default [0, 2]).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Group-relative advantage of each sample: (r - mean) / (std + eps) within its group."""
    centred = rewards - rewards.mean()
    if rewards.numel() < 2:
        return centred
    return centred / (rewards.std() + eps)


@dataclass(frozen=True)
class PolicyLossTerms:
    loss_sum: Tensor  # summed over masked tokens; the caller divides by the batch's token count
    tis_weight_sum: float
    tis_clipped: int  # tokens whose raw importance weight fell outside the interval
    logprob_diff_sum: float  # |log pi_train_old - log pi_rollout|
    kl_sum: float  # k1 estimate of KL(pi_rollout || pi_train_old)
    ratio_clipped: int  # tokens where the PPO clip was active
    tokens: int


def policy_loss(logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor,
                clip_eps: float, tis_interval: tuple[float, float]) -> PolicyLossTerms:
    """PPO-clip loss with truncated importance sampling, per token (all tensors [B, T]).

    One optimizer step per batch, so pi_old is the current policy without gradient.
    """
    mask = mask.to(logp.dtype)
    old_logp = logp.detach()
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    raw_weight = torch.exp(old_logp - rollout_logp)
    low, high = tis_interval
    weight = raw_weight.clamp(low, high)
    per_token = torch.maximum(unclipped, clipped) * weight
    active = mask.bool()
    with torch.no_grad():
        diff = old_logp - rollout_logp
        terms = dict(
            tis_weight_sum=float((weight * mask).sum()),
            tis_clipped=int(((raw_weight < low) | (raw_weight > high))[active].sum()),
            logprob_diff_sum=float((diff.abs() * mask).sum()),
            kl_sum=float((-diff * mask).sum()),
            ratio_clipped=int((clipped > unclipped)[active].sum()),
            tokens=int(mask.sum()),
        )
    return PolicyLossTerms(loss_sum=(per_token * mask).sum(), **terms)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] for each position, computed in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
