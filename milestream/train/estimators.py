"""Advantage estimators on plain tensors, chosen by ``trainer.advantage_estimator``.

A batch is B samples, each with one scalar reward, the index of its group (the samples of one
prompt) and a [T] response mask; the estimators turn it into per-token advantages [B, T] (zero
off the mask) and, where the estimator has them, returns [B, T]:

  grpo, gspo                    A_i = (r_i - mean_g r) / (std_g r + eps), the same on every token
                                (gspo differs in its loss: a sequence-level ratio, see losses.py);
                                group_normalize=False: A_i = r_i
  reinforce_plus_plus           token rewards (r_i on the last response token, minus the KL
                                penalty), discounted returns G_t = r_t + gamma G_{t+1}, whitened
  reinforce_plus_plus_baseline  r_i - mean_g r on every token (minus the KL penalty), whitened
  ppo                           GAE(gamma, lambda) on a learned value function V [B, T]

``token_rewards`` [B, T] (on-policy distillation's distill.mode reward: train/distill.py) add to those:
to the token rewards of reinforce_plus_plus and ppo, to every token of reinforce_plus_plus_baseline
(as its KL penalty), and summed over the response to the sample's reward for grpo and gspo.

Whitening is over the masked tokens of the whole batch, so these run once per training batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from milestream.config import TrainerConfig
from milestream.train.tensor_ops import masked_mean


@dataclass(frozen=True)
class AdvantageInputs:
    rewards: Tensor  # [B] one scalar per sample
    groups: Tensor  # [B] the group index of each sample
    mask: Tensor  # [B, T] 1 on the response tokens the loss sees
    old_logp: Tensor | None = None  # [B, T] the sampling policy, for the KL penalty
    ref_logp: Tensor | None = None  # [B, T] the reference policy, for the KL penalty
    values: Tensor | None = None  # [B, T] V(s_t) of the value head, for ppo
    token_rewards: Tensor | None = None  # [B, T] rewards of single tokens, beside each sample's (zero off the mask)
    # [B] 1 / its episode's trajectories: an agent's episode of several (leaves) counts once in its group's mean
    # and spread; None: every sample is an episode of its own
    weights: Tensor | None = None


@dataclass(frozen=True)
class AdvantageOptions:
    whiten: bool = False
    group_normalize: bool = True
    group_std_normalize: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef: float = 0.0


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # [B, T], zero off the mask
    returns: Tensor | None  # [B, T] regression targets of the value head, where the estimator has them


def advantage_options(cfg: TrainerConfig) -> AdvantageOptions:
    return AdvantageOptions(whiten=cfg.whiten_advantages, group_normalize=cfg.group_normalize,
                            group_std_normalize=cfg.group_std_normalize, gamma=cfg.gamma, lam=cfg.lam,
                            kl_coef=cfg.kl_coef)


def group_normalized(rewards: Tensor, groups: Tensor, std_normalize: bool = True, eps: float = 1e-6,
                     weights: Tensor | None = None) -> Tensor:
    """[B]: r_i - mean_g r, divided by (std_g r + eps) (unbiased std) when ``std_normalize``; with
    ``weights`` (AdvantageInputs.weights) the mean and spread are over episodes, each weighing 1.

    A group of one (episode) has no spread to divide by: its advantage is 0.
    """
    out = torch.empty_like(rewards)
    for group in groups.unique():
        members = groups == group
        own = rewards[members]
        if weights is None:
            centred = own - own.mean()
            out[members] = centred / (own.std() + eps) if std_normalize and own.numel() > 1 else centred
            continue
        share = weights[members].to(own.dtype)
        episodes = share.sum()
        centred = own - (share * own).sum() / episodes
        spread = ((share * centred ** 2).sum() / (episodes - 1)).sqrt() if episodes > 1.5 else None
        out[members] = centred / (spread + eps) if std_normalize and spread is not None else centred
    return out


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked tokens (biased variance, as slime), zero off the mask."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def reward_at_last_token(rewards: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: each sample's reward on its last masked token, zero elsewhere (and on an empty mask)."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    out = torch.zeros_like(mask, dtype=rewards.dtype)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows]
    return out


def kl_penalty(inputs: AdvantageInputs, kl_coef: float) -> Tensor:
    """[B, T]: kl_coef * (log pi_old - log pi_ref) on the masked tokens (the k1 estimate of the KL)."""
    if not kl_coef:
        return torch.zeros_like(inputs.mask)
    if inputs.old_logp is None or inputs.ref_logp is None:
        raise ValueError("a KL penalty needs old_logp and ref_logp")
    return kl_coef * (inputs.old_logp - inputs.ref_logp) * inputs.mask


def extra_token_rewards(inputs: AdvantageInputs) -> Tensor:
    """[B, T] ``inputs.token_rewards``, zero off the mask (and everywhere when there are none)."""
    if inputs.token_rewards is None:
        return torch.zeros_like(inputs.mask)
    return inputs.token_rewards * inputs.mask


def token_level_rewards(inputs: AdvantageInputs, kl_coef: float) -> Tensor:
    """[B, T]: the sample's reward on its last token, the token rewards, minus the KL penalty."""
    return reward_at_last_token(inputs.rewards, inputs.mask) + extra_token_rewards(inputs) - kl_penalty(inputs, kl_coef)


def discounted_sum(values: Tensor, mask: Tensor, discount: float) -> Tensor:
    """G_t = x_t + discount * G_next over the masked tokens, right to left, zero off the mask.

    Tokens off the mask (a multi-turn tool output) are not steps: G passes over them undiscounted.
    """
    out = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype)
    for t in reversed(range(values.shape[1])):
        on = mask[:, t] > 0
        running = torch.where(on, values[:, t] + discount * running, running)
        out[:, t] = running * on
    return out


def next_on_mask(values: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: at each token, the value of the next masked token of its row (0 after the last)."""
    out = torch.zeros_like(values)
    following = torch.zeros(values.shape[0], dtype=values.dtype)
    for t in reversed(range(values.shape[1])):
        out[:, t] = following
        following = torch.where(mask[:, t] > 0, values[:, t], following)
    return out


def grpo(inputs: AdvantageInputs, options: AdvantageOptions) -> Advantages:
    rewards = inputs.rewards + extra_token_rewards(inputs).sum(-1)
    if not options.group_normalize:
        return Advantages(rewards.view(-1, 1) * inputs.mask, None)
    per_sample = group_normalized(rewards, inputs.groups, options.group_std_normalize, weights=inputs.weights)
    return Advantages(per_sample.view(-1, 1) * inputs.mask, None)


def reinforce_plus_plus(inputs: AdvantageInputs, options: AdvantageOptions) -> Advantages:
    """A = whiten(G), G_t = r_t + gamma G_{t+1},
    r_t = R [t last] + token reward_t - kl_coef (log pi_old - log pi_ref)_t."""
    returns = discounted_sum(token_level_rewards(inputs, options.kl_coef), inputs.mask, options.gamma)
    return Advantages(masked_whiten(returns, inputs.mask), returns)


def reinforce_plus_plus_baseline(inputs: AdvantageInputs, options: AdvantageOptions) -> Advantages:
    """A = whiten(r_i - mean_g r + token reward_t - kl_coef (log pi_old - log pi_ref)_t)."""
    baseline = group_normalized(inputs.rewards, inputs.groups, std_normalize=False, weights=inputs.weights)
    advantages = baseline.view(-1, 1) * inputs.mask + extra_token_rewards(inputs) - kl_penalty(inputs, options.kl_coef)
    return Advantages(masked_whiten(advantages, inputs.mask), None)


def ppo_gae(inputs: AdvantageInputs, options: AdvantageOptions) -> Advantages:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, returns = A + V.

    r_t is the reward on the last token plus the token reward minus the KL penalty; V after the last token is 0.
    """
    if inputs.values is None:
        raise ValueError("the ppo estimator needs values [B, T] from a value head")
    mask, values = inputs.mask, inputs.values.detach() * inputs.mask
    deltas = token_level_rewards(inputs, options.kl_coef) + options.gamma * next_on_mask(values, mask) - values
    advantages = discounted_sum(deltas, mask, options.gamma * options.lam)
    return Advantages(advantages, (advantages + values) * mask)


ESTIMATORS: dict[str, Callable[[AdvantageInputs, AdvantageOptions], Advantages]] = {
    "grpo": grpo,
    "gspo": grpo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "ppo": ppo_gae,
}
_WHITENED = {reinforce_plus_plus, reinforce_plus_plus_baseline}


def compute_advantages(name: str, inputs: AdvantageInputs,
                       options: AdvantageOptions = AdvantageOptions()) -> Advantages:
    """The advantages of one training batch under the estimator ``name`` (a key of ESTIMATORS)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; one of {sorted(ESTIMATORS)}")
    estimator = ESTIMATORS[name]
    result = estimator(inputs, options)
    if options.whiten and estimator not in _WHITENED:
        return Advantages(masked_whiten(result.advantages, inputs.mask), result.returns)
    return result
