"""On-policy distillation on the trainer's side (``distill``, distill_config.py): the teacher's log-prob of
every sampled token (rollout.teacher_logprobs, joined into each sample) turned into the step's advantages
and figures.

The signal is d_t = log pi_rollout(y_t) - log pi_teacher(y_t) on each response token: over tokens drawn from
pi_rollout its mean estimates KL(pi_rollout || pi_teacher), the reverse KL to the teacher. pi_rollout (the
engine's log-prob, the policy that drew the token) rather than the trainer's pi_old: the tokens were drawn
from it, so the estimate holds at any staleness, and it is known before the step's first forward, so the
whole batch's advantages are fixed before any update. Under rollout.true_on_policy at staleness 0 the two are
the same floats. Each d_t is a log-ratio like the loss's (nan 0, clamped to +-trainer.log_ratio_clamp), so a
token the teacher finds impossible gives a large but finite signal.

  advantage  A_t = task_weight * A_task_t - coef * d_t, after the estimator and its whitening (as Miles)
  reward     the estimator sees task_weight * r and the token rewards -coef * d_t (train/estimators.py)

Step figures, over the batch's masked tokens: ``distill_kl`` (mean d: the k1 estimate), ``distill_kl_k3``
(mean e^-d - 1 + d, never negative, lower variance) and ``distill_logprob_diff`` (mean |d|: 0 exactly when
the teacher agrees with the rollout on every trained token).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import Tensor

from milestream.distill_config import DistillConfig
from milestream.schemas.records import GroupSample
from milestream.train.estimators import AdvantageInputs
from milestream.train.logprobs import pad
from milestream.train.losses import log_ratio


@dataclass(frozen=True)
class Distillation:
    cfg: DistillConfig
    clamp: float  # trainer.log_ratio_clamp

    def reverse_kl(self, samples: Sequence[GroupSample], mask: Tensor) -> Tensor:
        """[B, T] d_t of every masked response token of ``samples`` (zero off the mask)."""
        missing = [s.trajectory_id for s in samples if len(s.teacher_logprobs) != len(s.response_ids)]
        if missing:
            raise ValueError(f"distill: samples {missing[:3]} have no teacher log-prob for every response token")
        rollout = pad([s.logprobs for s in samples])
        teacher = pad([s.teacher_logprobs for s in samples])
        return log_ratio(rollout, teacher, self.clamp) * mask

    def estimator_inputs(self, inputs: AdvantageInputs, d: Tensor) -> AdvantageInputs:
        """What the estimator sees: in reward mode the task reward weighted and the teacher's token rewards
        (a group's normalisation then spans both); in advantage mode the task reward alone."""
        if self.cfg.mode == "reward":
            return replace(inputs, rewards=self.cfg.task_weight * inputs.rewards, token_rewards=-self.cfg.coef * d)
        return inputs

    def advantages(self, estimated: Tensor, d: Tensor) -> Tensor:
        """The step's advantages from the estimator's."""
        if self.cfg.mode == "reward":
            return estimated
        return self.cfg.task_weight * estimated - self.cfg.coef * d


def distill_figures(d: Tensor, mask: Tensor) -> dict[str, float]:
    """The step's distillation figures from d over the batch's masked tokens."""
    tokens = max(float(mask.sum()), 1.0)
    return {"distill_kl": float((d * mask).sum()) / tokens,
            "distill_kl_k3": float(((torch.exp(-d) - 1 + d) * mask).sum()) / tokens,
            "distill_logprob_diff": float((d.abs() * mask).sum()) / tokens}
