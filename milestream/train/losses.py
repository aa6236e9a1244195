"""One loss interface: ``Loss(LossInput) -> LossOutput``, with policy, value, supervised and user variants.

Three policies meet in a batch: pi_rollout sampled it (the engine's log-probs), pi_old is the
trainer's policy before the batch's first update (with ``trainer.updates_per_batch`` 1, the current
one, detached; with more, recorded by a forward before the first), pi the one being trained. The policy loss is PPO-clip on pi/pi_old (GSPO: on the geometric mean of
the ratios over the response; ``clip_eps_high``: DAPO's asymmetric clip; ``dual_clip_c``: dual-clip
PPO), times the rollout-training correction on pi_old/pi_rollout:

  tis          truncated importance sampling: weight clamped to ``interval`` (default [0, 2])
  clip_or_pop  masked importance sampling (IcePop): the weight inside ``interval``, tokens outside
               it popped (zero loss); they stay in the caller's token count
  none         weight 1

OPSM (``opsm_delta``) pops whole negative-advantage sequences whose rollout policy strayed too far
from pi_old. ``Regularized`` adds a KL loss against the reference policy and an entropy bonus.
Every log-ratio goes through ``log_ratio`` (nan to 0, then clamped) before exp, so a wild
log-prob (a rollout log-prob of -inf) gives a finite loss and finite gradients.

Every loss returns ``loss_sum`` summed over the masked tokens, optionally ``row_sums`` (each
sample's part of it, which the ``sample_mean`` reduction needs), and figures that are sums too,
each named for the per-token mean it gives once divided by the tokens (``step_figures`` has the
exceptions). ``reduce_loss`` turns a microbatch's sum into its share of the batch loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Protocol

import torch
from torch import Tensor, nn

from milestream.config import TrainerConfig, import_path
from milestream.train.tensor_ops import masked_mean

Correction = Literal["tis", "clip_or_pop", "none"]
Reduction = Literal["token_mean", "sample_mean", "seq_sum"]
KLType = Literal["k1", "k2", "k3"]
LOG_RATIO_CLAMP = 20.0  # e^20 ~ 5e8: far past any clip, and its square still fits float32
PER_SAMPLE_FIGURES = frozenset({"opsm_masked_frac"})  # sums over samples, not tokens


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
    ref_logp: Tensor | None = None  # [B, T] log pi_ref, without gradient (trainer.kl_loss_coef)
    entropy: Tensor | None = None  # [B, T] entropy of pi at each position, with gradient (trainer.entropy_coef)


@dataclass(frozen=True)
class LossOutput:
    loss_sum: Tensor  # summed over the masked tokens
    tokens: int  # masked tokens in this input
    figures: dict[str, float]  # sums over the masked tokens; / tokens gives what the name says
    # [B] each sample's part of loss_sum: the sample_mean reduction needs it (a user loss without it
    # still trains with token_mean and seq_sum)
    row_sums: Tensor | None = None


class Loss(Protocol):
    def __call__(self, batch: LossInput) -> LossOutput: ...


def log_ratio(numerator: Tensor, denominator: Tensor, clamp: float) -> Tensor:
    """numerator - denominator (two log-probs), finite and within [-clamp, clamp].

    nan becomes 0 and +-inf +-clamp before the clamp: exp of it, and the gradient through it
    (zero where the input was not finite or past the clamp), stay finite.
    """
    return torch.nan_to_num(numerator - denominator, nan=0.0, posinf=clamp, neginf=-clamp).clamp(-clamp, clamp)


def rollout_correction(log_weight: Tensor, kind: Correction, interval: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """(the weight on each token's loss, the tokens it clipped or popped) from log pi_old/pi_rollout."""
    raw = torch.exp(log_weight)
    low, high = interval
    outside = (raw < low) | (raw > high)
    if kind == "tis":
        return raw.clamp(low, high), outside
    if kind == "clip_or_pop":
        return raw.masked_fill(outside, 0.0), outside
    if kind == "none":
        return torch.ones_like(raw), torch.zeros_like(outside)
    raise ValueError(f"unknown rollout correction {kind!r}")


def mismatch_figures(log_weight: Tensor, mask: Tensor) -> dict[str, float]:
    """How far pi_rollout is from pi_old, summed over the masked tokens, from log w = log pi_old/pi_rollout.

    On tokens sampled from pi_rollout, KL(pi_rollout || pi_old) is estimated by k1 = -log w and by
    k3 = w - 1 - log w (unbiased too, never negative, lower variance). The two is_ess sums give the
    effective sample size of w over the batch (``step_figures``).
    """
    log_weight = log_weight.detach()
    weight = log_weight.exp()
    return {
        "logprob_diff": float((log_weight.abs() * mask).sum()),
        "kl_rollout_train": float((-log_weight * mask).sum()),
        "kl_rollout_train_k3": float(((weight - 1 - log_weight) * mask).sum()),
        "is_ess_sum_w": float((weight * mask).sum()),
        "is_ess_sum_w2": float((weight.square() * mask).sum()),
    }


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, clamp: float) -> Tensor:
    """[B, T]: GSPO's log s_i = mean over the response of log pi/pi_old, on every token of the row.

    Each token's log-ratio is clamped before the mean, so the mean is within the clamp too.
    """
    return masked_mean(log_ratio(logp, old_logp, clamp), mask, dim=-1).view(-1, 1).expand_as(logp)


def ppo_clip(ratio: Tensor, advantages: Tensor, low: float, high: float,
             dual_clip_c: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss, where the clip bit, where the dual clip bit).

    max(-A r, -A clip(r, low, high)); with dual clip, where A < 0 at most -c A (Ye et al. 2020).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(low, high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    return per_token, clipped > unclipped, dual


def opsm_keep(advantages: Tensor, log_weight: Tensor, mask: Tensor, delta: float | None) -> Tensor:
    """[B, 1]: 0 for a sequence OPSM masks (DeepSeek-V3.2), 1 otherwise.

    Masked: its advantage (the mean over its tokens) is negative and the mean over its tokens of
    log pi_rollout - log pi_old exceeds ``delta``: a bad sample the current policy would hardly have
    drawn teaches little and destabilises.
    """
    if delta is None:
        return torch.ones(advantages.shape[0], 1, dtype=advantages.dtype, device=advantages.device)
    negative = masked_mean(advantages, mask, dim=-1) < 0
    strayed = masked_mean(-log_weight, mask, dim=-1) > delta
    return (~(negative & strayed)).to(advantages.dtype).view(-1, 1)


@dataclass(frozen=True)
class PolicyLoss:
    """-min(r A, clip(r, 1 - eps, 1 + eps_high) A) [dual clip] * correction weight [* OPSM], per token."""

    clip_eps: float = 0.2
    correction: Correction = "tis"
    interval: tuple[float, float] = (0.0, 2.0)
    sequence_ratio: bool = False  # GSPO: r is the sequence's ratio, clipped as a whole
    clip_eps_high: float | None = None  # None: clip_eps
    dual_clip_c: float | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP
    opsm_delta: float | None = None

    def __call__(self, batch: LossInput) -> LossOutput:
        mask = batch.mask.to(batch.logp.dtype)
        clamp = self.log_ratio_clamp
        if self.sequence_ratio:
            ratio = torch.exp(sequence_log_ratio(batch.logp, batch.old_logp, mask, clamp))
        else:
            ratio = torch.exp(log_ratio(batch.logp, batch.old_logp, clamp))
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        per_token, clipped, dual = ppo_clip(ratio, batch.advantages, 1 - self.clip_eps, 1 + high, self.dual_clip_c)
        log_weight = log_ratio(batch.old_logp, batch.rollout_logp, clamp)
        weight, corrected = rollout_correction(log_weight, self.correction, self.interval)
        keep = opsm_keep(batch.advantages, log_weight, mask, self.opsm_delta)
        token_losses = per_token * weight * keep * mask
        active = mask.bool()
        with torch.no_grad():
            figures = {
                "ratio_mean": float((ratio * mask).sum()),
                "ppo_clip_frac": float(clipped[active].sum()),
                "is_weight_mean": float((weight * mask).sum()),
                "is_corrected_frac": float(corrected[active].sum()),
                **mismatch_figures(log_weight, mask),
            }
            if self.dual_clip_c is not None:
                figures["ppo_dual_clip_frac"] = float(dual[active].sum())
            if self.opsm_delta is not None:
                figures["opsm_masked_frac"] = float((keep == 0).sum())  # sequences: a PER_SAMPLE_FIGURE
        return LossOutput(token_losses.sum(), int(mask.sum()), figures, token_losses.sum(-1))


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
        token_losses = per_token * mask
        loss_sum = token_losses.sum()
        figures = {"value_loss": loss_sum.item(), "value_clip_frac": float((clipped > unclipped)[mask.bool()].sum())}
        return LossOutput(loss_sum, int(mask.sum()), figures, token_losses.sum(-1))


@dataclass(frozen=True)
class ActorCriticLoss:
    """PPO with a learned value function: policy loss + value_coef * value loss."""

    policy: PolicyLoss
    value: ValueLoss
    value_coef: float

    def __call__(self, batch: LossInput) -> LossOutput:
        policy, value = self.policy(batch), self.value(batch)
        return LossOutput(policy.loss_sum + self.value_coef * value.loss_sum, policy.tokens,
                          {**policy.figures, **value.figures}, policy.row_sums + self.value_coef * value.row_sums)


def supervised_loss(batch: LossInput) -> LossOutput:
    """Negative log-likelihood of the masked tokens (SFT): -sum log pi."""
    mask = batch.mask.to(batch.logp.dtype)
    token_losses = -(batch.logp * mask)
    loss_sum = token_losses.sum()
    return LossOutput(loss_sum, int(mask.sum()), {"nll_mean": loss_sum.item()}, token_losses.sum(-1))


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLType, clamp: float = LOG_RATIO_CLAMP) -> Tensor:
    """[B, T] per-token estimate of KL(pi || pi_ref), with gradient through log pi.

    With d = log pi - log pi_ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) + d - 1 (never negative,
    lower variance: GRPO's).
    """
    d = log_ratio(logp, ref_logp, clamp)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return torch.exp(-d) + d - 1
    raise ValueError(f"unknown KL estimator {kind!r}")


@dataclass(frozen=True)
class Regularized:
    """``base`` + kl_coef * KL(pi || pi_ref) - entropy_coef * H(pi), per masked token, reduced with it."""

    base: Loss
    kl_coef: float = 0.0
    kl_type: KLType = "k3"
    entropy_coef: float = 0.0
    log_ratio_clamp: float = LOG_RATIO_CLAMP

    def __call__(self, batch: LossInput) -> LossOutput:
        out = self.base(batch)
        mask = batch.mask.to(batch.logp.dtype)
        per_token = torch.zeros_like(batch.logp)
        figures = dict(out.figures)
        if self.kl_coef:
            if batch.ref_logp is None:
                raise ValueError("trainer.kl_loss_coef needs ref_logp, the reference policy's log-probs")
            kl = kl_estimate(batch.logp, batch.ref_logp, self.kl_type, self.log_ratio_clamp)
            per_token = per_token + self.kl_coef * kl
            figures["kl_ref"] = float((kl.detach() * mask).sum())
        if self.entropy_coef:
            if batch.entropy is None:
                raise ValueError("trainer.entropy_coef needs the entropy of the policy at each position")
            per_token = per_token - self.entropy_coef * batch.entropy
            figures["entropy"] = float((batch.entropy.detach() * mask).sum())
        rows = (per_token * mask).sum(-1)
        row_sums = None if out.row_sums is None else out.row_sums + rows
        return LossOutput(out.loss_sum + rows.sum(), out.tokens, figures, row_sums)


@dataclass(frozen=True)
class Denominators:
    """What the whole batch's loss is divided by, known before its first microbatch runs."""

    tokens: int  # masked tokens in the batch (token_mean)
    samples: int  # samples in the batch (sample_mean, seq_sum)
    seq_sum_length: int  # seq_sum's constant tokens per sample: rollout.max_new_tokens (Dr. GRPO)


def reduce_loss(out: LossOutput, mask: Tensor, reduction: Reduction, batch: Denominators) -> Tensor:
    """This microbatch's share of the batch loss: summed over the microbatches (and ranks) of the
    batch, it is the batch's loss under ``reduction``.

    token_mean   sum over the batch's masked tokens / its tokens: long answers weigh by their length
    sample_mean  each sample's mean over its tokens, then the mean over the batch's samples (Miles)
    seq_sum      sum over the tokens / (samples x seq_sum_length), a constant (Dr. GRPO): no length bias
    """
    if reduction == "token_mean":
        return out.loss_sum / max(batch.tokens, 1)
    if reduction == "seq_sum":
        return out.loss_sum / (max(batch.samples, 1) * batch.seq_sum_length)
    if reduction == "sample_mean":
        if out.row_sums is None:
            raise ValueError("trainer.loss_reduction=sample_mean needs each sample's loss: the loss must "
                             "return LossOutput.row_sums")
        return (out.row_sums / mask.sum(-1).clamp(min=1)).sum() / max(batch.samples, 1)
    raise ValueError(f"unknown loss reduction {reduction!r}")


def step_figures(sums: Mapping[str, float], tokens: float, samples: int) -> dict[str, float]:
    """The batch's figures from the loss's sums over every microbatch and rank: each divided by the
    batch's tokens (by its samples: PER_SAMPLE_FIGURES), and is_ess = (sum w)^2 / (n sum w^2) over
    its n masked tokens, in (0, 1]: 1 when every correction weight is equal."""
    figures = dict(sums)
    sum_w, sum_w2 = figures.pop("is_ess_sum_w", None), figures.pop("is_ess_sum_w2", None)
    out = {name: total / (max(samples, 1) if name in PER_SAMPLE_FIGURES else tokens)
           for name, total in figures.items()}
    if sum_w is not None and sum_w2 is not None:
        out["is_ess"] = sum_w ** 2 / (tokens * sum_w2) if sum_w2 > 0 else 1.0
    return out


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the last hidden state of each token: [B, T, hidden] -> [B, T]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.proj(hidden_states).squeeze(-1)


def make_loss(cfg: TrainerConfig) -> Loss:
    """The loss ``cfg`` names (``objective_loss``), with the KL loss and entropy bonus when they are on."""
    loss = objective_loss(cfg)
    if cfg.kl_loss_coef or cfg.entropy_coef:
        return Regularized(loss, cfg.kl_loss_coef, cfg.kl_loss_type, cfg.entropy_coef, cfg.log_ratio_clamp)
    return loss


def objective_loss(cfg: TrainerConfig) -> Loss:
    """A user loss (``cfg.loss``), supervised NLL, or the policy loss of its estimator."""
    if cfg.loss:
        return import_path(cfg.loss, "trainer.loss")
    if cfg.objective == "supervised":
        return supervised_loss
    policy = PolicyLoss(cfg.clip_eps, cfg.correction, cfg.tis_interval,
                        sequence_ratio=cfg.advantage_estimator == "gspo", clip_eps_high=cfg.clip_eps_high,
                        dual_clip_c=cfg.dual_clip_c, log_ratio_clamp=cfg.log_ratio_clamp, opsm_delta=cfg.opsm_delta)
    if cfg.advantage_estimator == "ppo":
        return ActorCriticLoss(policy, ValueLoss(cfg.value_clip), cfg.value_coef)
    return policy
