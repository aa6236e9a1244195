"""One training step on a batch of groups, whatever the backend: the trainer's arithmetic, free of Kafka.

    advantages  trainer.advantage_estimator over the whole batch (train/estimators.py); ppo's
                GAE reads the value head's V before the first update (a forward without gradient);
                with distill, the teacher's reverse KL joins them (train/distill.py)
    updates     trainer.updates_per_batch optimizer steps, each on a minibatch of whole groups in
                order, against pi_old = the policy before the first (a forward without gradient when
                there is more than one; with one, pi detached)
    loss        make_loss(trainer) per prompt of each group, reduced by trainer.loss_reduction over
                denominators of the update's minibatch (its tokens or its samples: losses.reduce_loss)
    step        the backend's (local, FSDP2 or Megatron-core): backward, clip, AdamW (skipped when
                the loss or the gradient norm is not finite: update_skipped)

The trainer runs it on every rank; ``milestream replay --step N`` runs it on the logged batch.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

from milestream.config import Config
from milestream.train.backends import StepResult, TrainBackend, make_backend
from milestream.train.backends.base import LossFn, share
from milestream.train.distill import Distillation, distill_figures
from milestream.train.estimators import AdvantageInputs, advantage_options, compute_advantages
from milestream.train.logprobs import pad
from milestream.train.mismatch_breakdown import MismatchBreakdown
from milestream.train.losses import Denominators, LossInput, make_loss, reduce_loss, step_figures
from milestream.train.routing_replay import recorded_routing
from milestream.schemas.records import GroupSample, episode_mean


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
    returns: torch.Tensor | None = None  # ppo: the value targets, and V before the step
    old_values: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # log pi_ref (trainer.kl_coef, kl_loss_coef)
    old_logp: torch.Tensor | None = None  # log pi_old when it is not pi (trainer.updates_per_batch > 1)


class Learner:
    def __init__(self, cfg: Config, backend: TrainBackend | None = None):
        self.cfg = cfg
        self.backend = backend or make_backend(cfg)
        trainer = cfg.trainer
        self.loss = make_loss(trainer)
        self.with_values = trainer.advantage_estimator == "ppo"
        self.with_entropy = bool(trainer.entropy_coef)
        self.with_reference = bool(trainer.kl_coef or trainer.kl_loss_coef)
        self.distill = Distillation(cfg.distill, trainer.log_ratio_clamp) if cfg.distill.enabled else None
        for needed, method, why in ((self.with_values, "policy_forward", "ppo's value head"),
                                    (self.with_entropy, "policy_forward", "trainer.entropy_coef's entropy"),
                                    (self.with_reference, "reference_logprobs", "the reference policy of "
                                     "trainer.kl_coef / kl_loss_coef")):
            if needed and not hasattr(self.backend, method):
                raise ValueError(f"{why} runs on trainer.backend=local, not {trainer.backend}")

    def train_step(self, batch: Sequence[CollectedGroup]) -> dict[str, float]:
        """trainer.updates_per_batch optimizer steps over the batch; the step's figures (``_figures``)."""
        trainer = self.cfg.trainer
        updates = trainer.updates_per_batch
        if len(batch) < updates:
            raise ValueError(f"trainer.updates_per_batch={updates} needs at least {updates} groups, got {len(batch)}")
        microbatches = self._microbatches(batch)
        if updates > 1:
            microbatches = self._with_old_logprobs(microbatches)
        per_group = [len(by_prompt(g.samples)) for g in batch]
        breakdown = MismatchBreakdown.of([(g.samples, g.staleness) for g in batch], trainer.log_ratio_clamp)
        results = [self.backend.step(part, self._loss_fn(part, breakdown), trainer.max_grad_norm)
                   for part in minibatches(microbatches, per_group, updates)]
        return self._figures(batch, results, breakdown)

    def _loss_fn(self, minibatch: Sequence[PromptRows], breakdown: MismatchBreakdown) -> LossFn:
        """Each microbatch's share of the loss of ``minibatch``, a mean over its tokens or samples."""
        samples = [s for rows in minibatch for s in rows.samples]
        denominators = Denominators(tokens=sum(sum(s.loss_mask) for s in samples), samples=len(samples),
                                    seq_sum_length=self.cfg.rollout.max_new_tokens)

        def loss_fn(rows: PromptRows) -> tuple[torch.Tensor, dict[str, float]]:
            logp, values, entropy = self._forward(rows)
            mask = pad([s.loss_mask for s in rows.samples]).to(logp.device)
            rollout_logp = pad([s.logprobs for s in rows.samples]).to(logp.device)
            width = mask.shape[1]
            advantages = rows.advantages[:, :width].to(logp.device)
            returns, old_values, ref_logp = ((t[:, :width].to(logp.device) if t is not None else None)
                                             for t in (rows.returns, rows.old_values, rows.ref_logp))
            # one update per batch: pi_old is pi itself, detached
            old_logp = logp.detach() if rows.old_logp is None else rows.old_logp.to(logp.device)
            out = self.loss(LossInput(logp, old_logp, rollout_logp, advantages, mask,
                                      returns=returns, values=values, old_values=old_values, ref_logp=ref_logp,
                                      entropy=entropy))
            loss = reduce_loss(out, mask, self.cfg.trainer.loss_reduction, denominators)
            figures = {**out.figures, "tokens": float(out.tokens)}
            if "logprob_diff" in figures:  # the loss measures the rollout mismatch: so does its breakdown
                figures.update(breakdown.sums(old_logp, rollout_logp, mask, rows.samples))
            return loss, figures
        return loss_fn

    def _figures(self, batch: Sequence[CollectedGroup], results: Sequence[StepResult],
                 breakdown: MismatchBreakdown) -> dict[str, float]:
        """loss and grad_norm of the last update (a mean over its minibatch), updates, update_skipped
        (how many were), the batch's rewards and lengths; the loss's figures (ppo_clip_frac, the
        rollout mismatch, value_loss, ...) are their sums over every update divided by the batch's
        tokens: each token counts once, as its update saw it; the mismatch's breakdown
        (train/mismatch_breakdown.py)."""
        samples = [s for g in batch for s in g.samples]
        figures = dict(results[0].figures)
        for result in results[1:]:
            for name, value in result.figures.items():
                figures[name] += value
        tokens = max(figures.pop("tokens"), 1.0)
        mismatch = breakdown.figures(figures)
        return {
            "loss": results[-1].loss, "grad_norm": results[-1].grad_norm,
            "update_skipped": float(sum(r.update_skipped for r in results)), "updates": float(len(results)),
            "reward_mean": episode_mean(samples),
            **step_figures(figures, tokens, len(samples)),  # the loss's figures, per token (or sample)
            **mismatch, **self._distill_figures(samples),
            "response_len_mean": tokens / len(samples), "samples": float(len(samples)),
        }

    def _distill_figures(self, samples: Sequence[GroupSample]) -> dict[str, float]:
        """How far the batch's rollout policy is from the teacher on its trained tokens (train/distill.py)."""
        if self.distill is None:
            return {}
        mask = pad([s.loss_mask for s in samples])
        return distill_figures(self.distill.reverse_kl(samples, mask), mask)

    def _with_old_logprobs(self, microbatches: Sequence[PromptRows]) -> list[PromptRows]:
        """The microbatches with log pi_old, the policy before the first update: the same forward as
        the loss's (so the first update's ratio is 1), without gradient."""
        with torch.no_grad():
            return [replace(rows, old_logp=self._forward(rows)[0].detach()) for rows in microbatches]

    def _forward(self, rows: PromptRows) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """pi's log-probs, with gradient, and where the objective needs them V and the entropy."""
        responses = [s.response_ids for s in rows.samples]
        replay = self._routing(rows.samples)
        if self.with_values or self.with_entropy:
            return self.backend.policy_forward(rows.prompt_ids, responses, self.cfg.rollout.temperature,
                                               values=self.with_values, entropy=self.with_entropy, **replay)
        return self.backend.logprobs(rows.prompt_ids, responses, self.cfg.rollout.temperature, **replay), None, None

    def _routing(self, samples: Sequence[GroupSample]) -> dict[str, Any]:
        """The backend's ``routing`` argument when the samples' recorded MoE routing is replayed."""
        routing = recorded_routing(self.cfg.trainer, samples)
        return {} if routing is None else {"routing": routing}

    def _microbatches(self, batch: Sequence[CollectedGroup]) -> list[PromptRows]:
        """Advantages over the whole batch (some estimators whiten across it), cut per group and prompt."""
        parts = [(prompt_ids, rows) for g in batch for prompt_ids, rows in by_prompt(g.samples)]
        samples = [s for _, rows in parts for s in rows]
        group_of = {id(s): i for i, g in enumerate(batch) for s in g.samples}
        reference = self._reference_logprobs(parts) if self.with_reference else None
        mask = pad([s.loss_mask for s in samples])
        inputs = AdvantageInputs(torch.tensor([s.reward for s in samples]),
                                 torch.tensor([group_of[id(s)] for s in samples]), mask,
                                 weights=(torch.tensor([1.0 / s.leaves for s in samples])
                                          if any(s.leaves > 1 for s in samples) else None),
                                 # the KL penalty compares the policy that sampled with the reference
                                 old_logp=pad([s.logprobs for s in samples]) if self.with_reference else None,
                                 ref_logp=reference,
                                 values=self._values_before_step(parts) if self.with_values else None)
        distilled = self.distill.reverse_kl(samples, mask) if self.distill else None
        if distilled is not None:
            inputs = self.distill.estimator_inputs(inputs, distilled)
        result = compute_advantages(self.cfg.trainer.advantage_estimator, inputs, advantage_options(self.cfg.trainer))
        advantages = result.advantages if distilled is None else self.distill.advantages(result.advantages, distilled)
        sizes = [len(rows) for _, rows in parts]
        split = lambda t: t.split(sizes) if t is not None else [None] * len(parts)  # noqa: E731
        return [PromptRows(prompt_ids, rows, advantages, returns, old_values, ref_logp)
                for (prompt_ids, rows), advantages, returns, old_values, ref_logp
                in zip(parts, advantages.split(sizes), split(result.returns), split(inputs.values), split(reference))]

    def _reference_logprobs(self, parts: list[tuple[list[int], list[GroupSample]]]) -> torch.Tensor:
        rows = [r for prompt_ids, samples in parts
                for r in self.backend.reference_logprobs(prompt_ids, [s.response_ids for s in samples],
                                                         self.cfg.rollout.temperature).cpu()]
        return _stack_padded(rows)

    def _values_before_step(self, parts: list[tuple[list[int], list[GroupSample]]]) -> torch.Tensor:
        """V of every response token under the current value head, [samples, longest response]."""
        with torch.no_grad():
            rows = [v for prompt_ids, samples in parts
                    for v in self.backend.policy_forward(prompt_ids, [s.response_ids for s in samples],
                                                         self.cfg.rollout.temperature, values=True,
                                                         **self._routing(samples))[1].cpu()]
        return _stack_padded(rows)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.backend.export_weights()

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.backend.load_state_dict(state)


def _stack_padded(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of per-group widths, right-padded with 0 to the longest: [len(rows), longest]."""
    longest = max(row.shape[0] for row in rows)
    return torch.stack([torch.nn.functional.pad(row, (0, longest - row.shape[0])) for row in rows])


def minibatches(microbatches: Sequence[PromptRows], per_group: Sequence[int], updates: int) -> list[list[PromptRows]]:
    """``microbatches`` (``per_group[i]`` of them from group i, in order) cut into ``updates`` runs of
    whole groups, in order, whose group counts differ by at most one."""
    counts = [sum(share(per_group, index, updates)) for index in range(updates)]
    return [list(microbatches[start:start + count])
            for start, count in zip(itertools.accumulate(counts, initial=0), counts)]


def by_prompt(samples: Sequence[GroupSample]) -> list[tuple[list[int], list[GroupSample]]]:
    rows: dict[tuple[int, ...], list[GroupSample]] = {}
    for sample in samples:
        rows.setdefault(tuple(sample.prompt_ids), []).append(sample)
    return [(list(prompt), group) for prompt, group in rows.items()]
