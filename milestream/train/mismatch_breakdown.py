"""The step's rollout-train mismatch broken down: by response position, by weight-version lag, by token.

``logprob_diff`` (losses.mismatch_figures) is the batch's mean |log pi_old - log pi_rollout| over its
masked tokens. Where it comes from shows in these step figures on ``buffer.metrics``:

  logprob_diff_pos_0_15, _pos_16_63,     the same mean over the masked tokens at those positions of
  _pos_64_255, _pos_256_up               their response (0: the first response token)
  logprob_diff_lag_0, _lag_1, _lag_2_up  over the masked tokens whose weight version is that many
                                         versions behind pi_old's (the trainer's version at the step)
  logprob_diff_top{i}_token, _sum,       i = 1..5: the token ids with the largest summed |diff| in the
  _count                                 batch, that sum and how many masked tokens of it the batch held

A bucket that holds no token is left out, and so is a token whose sum is 0: with rollout.true_on_policy
at staleness 0 the buckets are 0.0 and there are no top tokens.

Each microbatch's loss function adds its sums (``MismatchBreakdown.sums``); the counts come from the
batch itself. The sums have the same names in every call, update and rank (the token ones name every
token of the batch, which every rank holds), as ``backends.base.sum_across_ranks`` requires.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor

from milestream.schemas.records import GroupSample
from milestream.train.logprobs import pad
from milestream.train.losses import log_ratio

# (first, last + 1, name)
POSITIONS = ((0, 16, "pos_0_15"), (16, 64, "pos_16_63"), (64, 256, "pos_64_255"), (256, math.inf, "pos_256_up"))
LAGS = ((0, 1, "lag_0"), (1, 2, "lag_1"), (2, math.inf, "lag_2_up"))
TOP_TOKENS = 5
PREFIX = "logprob_diff_"
RAW = "mismatch_sum:"  # the loss function's raw sums, turned into the figures above by ``figures``


def trainer_version(groups: Iterable[tuple[Sequence[GroupSample], int]]) -> int:
    """pi_old's version from (samples, staleness) of the batch's groups: staleness = it - the oldest token's."""
    for samples, staleness in groups:
        versions = [v for s in samples for v in s.token_versions]
        if versions:
            return min(versions) + staleness
    return 0


def _buckets(values: Tensor, mask: Tensor, edges: Sequence[tuple[int, float, str]]) -> dict[str, Tensor]:
    """name -> the masked tokens whose ``values`` fall in that bucket."""
    return {name: mask & (values >= low) & (values < high) for low, high, name in edges}


@dataclass(frozen=True)
class MismatchBreakdown:
    token_ids: Tensor  # the distinct masked response token ids of the batch, ascending
    token_counts: Tensor  # how many masked tokens of each the batch holds
    bucket_counts: dict[str, int]  # masked tokens per position and lag bucket
    version: int  # pi_old's
    clamp: float  # trainer.log_ratio_clamp, as the loss clamps log pi_old - log pi_rollout

    @functools.cached_property
    def token_names(self) -> tuple[str, ...]:
        return tuple(f"{RAW}{t}" for t in self.token_ids.tolist())

    @classmethod
    def of(cls, groups: Sequence[tuple[Sequence[GroupSample], int]], clamp: float) -> "MismatchBreakdown":
        """The batch's counts, from its groups' (samples, staleness)."""
        version = trainer_version(groups)
        samples = [s for group, _ in groups for s in group]
        ids, positions, lags, mask = _layout(samples, version)
        token_ids, token_counts = torch.unique(ids[mask], return_counts=True)
        buckets = {**_buckets(positions, mask, POSITIONS), **_buckets(lags, mask, LAGS)}
        return cls(token_ids, token_counts, {name: int(b.sum()) for name, b in buckets.items()}, version, clamp)

    def sums(self, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
             samples: Sequence[GroupSample]) -> dict[str, float]:
        """A microbatch's summed |log pi_old - log pi_rollout| per bucket and per token of the batch."""
        diff = log_ratio(old_logp.detach(), rollout_logp, self.clamp).abs().cpu()
        ids, positions, lags, active = _layout(samples, self.version)
        active &= mask.cpu().bool()
        buckets = {**_buckets(positions, active, POSITIONS), **_buckets(lags, active, LAGS)}
        out = {f"{RAW}{name}": float(diff[b].sum()) for name, b in buckets.items()}
        per_token = torch.zeros(len(self.token_ids), dtype=torch.float64).index_add_(
            0, torch.searchsorted(self.token_ids, ids[active]), diff[active].double())
        out.update(zip(self.token_names, per_token.tolist()))
        return out

    def figures(self, totals: dict[str, float]) -> dict[str, float]:
        """The step's figures (above) from the batch's summed ``sums``, which it removes from ``totals``."""
        raw = {name[len(RAW):]: totals.pop(name) for name in [n for n in totals if n.startswith(RAW)]}
        if not raw:  # the loss reports no rollout mismatch (supervised, a loss of your own)
            return {}
        out = {f"{PREFIX}{name}": raw[name] / count for name, count in self.bucket_counts.items() if count}
        ranked = sorted(((raw[str(t)], t, n) for t, n in zip(self.token_ids.tolist(), self.token_counts.tolist())
                         if raw[str(t)] > 0), reverse=True)
        for rank, (total, token, count) in enumerate(ranked[:TOP_TOKENS], start=1):
            out.update({f"{PREFIX}top{rank}_token": float(token), f"{PREFIX}top{rank}_sum": total,
                        f"{PREFIX}top{rank}_count": float(count)})
        return out


def _layout(samples: Sequence[GroupSample], version: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """[B, T] token ids, response positions, version lags and loss mask (bool) of ``samples``, right-padded."""
    ids = pad([s.response_ids for s in samples], dtype=torch.long)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    lags = version - pad([s.token_versions for s in samples], value=version, dtype=torch.long)
    mask = pad([s.loss_mask for s in samples], dtype=torch.long).bool()
    return ids, positions, lags, mask
