"""Tensor pieces the advantage estimators, the losses and the log-prob forward share.

Every [B, T] tensor is right-padded; ``mask`` is 1 on the response tokens the loss sees (a
multi-turn mask may have holes: tool output the policy did not write).
"""
from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is 1 (over all of them, or along ``dim``)."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] for each position, computed in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``token_logprobs`` and the entropy -sum_v p log p of each position's distribution, in fp32.

    log p is floored at -1e4 inside the product: where p is 0 (a logit of -inf) p log p is 0 and so
    is its gradient, where 0 * -inf would give nan. No p of fp32 is nonzero below e^-104.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp.clamp(min=-1e4)).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy
