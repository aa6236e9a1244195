"""The trainer: collect groups from ``buffer.groups``, take a GRPO step, publish the new version.

  collect  batch_groups fresh groups; a stale one (current version - oldest token version >
           max_staleness) is dropped onto buffer.dropped instead, as Miles does at collection
  step     advantages (trainer.advantage_estimator), the loss of make_loss (default: PPO-clip with
           truncated importance sampling), AdamW
  publish  the new weights on weights.versions, the step's figures on buffer.metrics
  persist  model + optimizer + RNG + consumed offsets, atomically, every checkpoint_every steps
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import torch

from milestream.config import Config
from milestream.consumers import checkpoint
from milestream.consumers.logprobs import pad, shared_prompt_logprobs
from milestream.consumers.estimators import AdvantageInputs, advantage_options, compute_advantages
from milestream.consumers.losses import LossInput, make_loss
from milestream.consumers.collector import GroupCollector
from milestream.infra.kafka import Admin, RecordProducer
from milestream.infra.model import (compute_dtype, configure_process, load_model, load_trainable_state_dict,
                                    trainable_state_dict)
from milestream.schemas import topics
from milestream.schemas.records import GroupSample, Metrics
from milestream.streams import weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectedGroup:
    group_id: str
    samples: list[GroupSample]
    staleness: int


class Trainer:
    def __init__(self, cfg: Config):
        configure_process(cfg.model)
        self.cfg = cfg
        self.model = load_model(cfg.model, dtype=torch.float32).train()  # fp32 master weights
        self.autocast = compute_dtype(cfg.model) == torch.bfloat16
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay)
        self.state = self._resume()
        self.producer = RecordProducer(cfg.broker, client_id="trainer")
        self.collector = GroupCollector(cfg, self.producer, self.state.offsets,
                                        Admin(cfg.broker).partitions(topics.GROUPS), self.state.seen_groups)
        self.stopping = False

    def _resume(self) -> checkpoint.TrainerState:
        payload = checkpoint.load_latest(self.cfg.run.run_dir)
        if payload is None:
            return checkpoint.TrainerState()
        load_trainable_state_dict(self.model, payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        state = checkpoint.restore(payload)
        log.info("resumed at step %d (version %d), offsets %s", state.step, state.version, state.offsets)
        return state

    def run(self) -> None:
        while self.state.step < self.cfg.trainer.steps and not self.stopping:
            started = time.monotonic()
            batch = self.collect()
            if batch is None:
                break
            figures = self.train_step(batch)
            self.state.step += 1
            self.state.version += 1
            weights.publish_version(self.producer, self.cfg.run.run_dir, self.state.version, self.state.step,
                                    trainable_state_dict(self.model), keep=self.cfg.trainer.keep_weight_versions)
            if self.state.step % self.cfg.trainer.checkpoint_every == 0 or self.state.step == self.cfg.trainer.steps:
                self.save()
            self._publish_metrics(batch, {**figures, "step_s": time.monotonic() - started})
        if self.stopping and self.state.step % self.cfg.trainer.checkpoint_every:
            self.save()
        self.producer.flush()
        self.collector.close()

    def collect(self) -> list[CollectedGroup] | None:
        taken = self.collector.take(self.cfg.trainer.batch_groups, self.state.version, lambda: self.stopping)
        if taken is None:
            return None
        return [CollectedGroup(group.group_id, group.samples, lag) for group, lag in taken]

    def train_step(self, batch: list[CollectedGroup]) -> dict[str, float]:
        """One optimizer step over the batch, one forward/backward per group (its prompt run once)."""
        samples = [s for g in batch for s in g.samples]
        total_tokens = sum(sum(s.loss_mask) for s in samples)
        sizes = [len(g.samples) for g in batch]
        inputs = AdvantageInputs(torch.tensor([s.reward for s in samples]),
                                 torch.arange(len(batch)).repeat_interleave(torch.tensor(sizes)),
                                 pad([s.loss_mask for s in samples]))
        advantages = compute_advantages(self.cfg.trainer.advantage_estimator, inputs,
                                        advantage_options(self.cfg.trainer)).advantages
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for group, group_advantages in zip(batch, advantages.split(sizes)):
            for key, value in self._group_backward(group.samples, group_advantages, total_tokens).items():
                totals[key] = totals.get(key, 0.0) + value
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.trainer.max_grad_norm))
        self.optimizer.step()
        rewards = [s.reward for s in samples]
        tokens = max(totals.pop("tokens"), 1.0)
        loss = totals.pop("loss")
        return {
            "loss": loss, "grad_norm": grad_norm, "reward_mean": sum(rewards) / len(rewards),
            **{name: total / tokens for name, total in totals.items()},  # the loss's figures, per token
            "response_len_mean": tokens / len(samples), "samples": float(len(samples)),
        }

    def _group_backward(self, samples: list[GroupSample], advantages: torch.Tensor,
                        total_tokens: int) -> dict[str, float]:
        """Accumulate the group's share of the batch loss (averaged over all tokens of the batch)."""
        loss_fn = make_loss(self.cfg.trainer)
        totals: dict[str, float] = {}
        for prompt_ids, rows in _by_prompt(samples):  # one group shares one prompt; multi-turn may not
            mask = pad([s.loss_mask for s in rows])
            rollout_logp = pad([s.logprobs for s in rows])
            adv = advantages[[s.sample_index for s in rows], :mask.shape[1]]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                logp = shared_prompt_logprobs(self.model, prompt_ids, [s.response_ids for s in rows],
                                              self.cfg.rollout.temperature)
            out = loss_fn(LossInput(logp, logp.detach(), rollout_logp, adv, mask))  # one step a batch: pi_old = pi
            loss = out.loss_sum / max(total_tokens, 1)
            loss.backward()
            for key, value in {**out.figures, "loss": loss.item(), "tokens": out.tokens}.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def save(self) -> None:
        self.state.offsets = self.collector.offsets()
        checkpoint.save(self.cfg.run.run_dir, self.state, trainable_state_dict(self.model), self.optimizer)

    def _publish_metrics(self, batch: list[CollectedGroup], figures: dict[str, float]) -> None:
        lags = [g.staleness for g in batch]
        values = {**figures, "version": float(self.state.version),
                  **self.collector.credit.queue_figures(self.state.version),
                  "credit_available": float(self.collector.credit.available()),
                  "staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
                  **self.collector.pool_figures(self.state.version)}
        record = Metrics("trainer", self.state.step, time.time(), values, [g.group_id for g in batch], lags)
        self.producer.send(topics.METRICS, [record], key="trainer")
        self.producer.flush()
        log.info("step %d reward %.3f loss %.4f staleness %.2f/%d queue %d (%.1fs)", self.state.step,
                 values["reward_mean"], values["loss"], values["staleness_mean"], max(lags), values["queue_size"],
                 figures["step_s"])


def _by_prompt(samples: list[GroupSample]) -> list[tuple[list[int], list[GroupSample]]]:
    rows: dict[tuple[int, ...], list[GroupSample]] = {}
    for sample in samples:
        rows.setdefault(tuple(sample.prompt_ids), []).append(sample)
    return [(list(prompt), group) for prompt, group in rows.items()]


def run_trainer(cfg: Config) -> None:
    trainer = Trainer(cfg)

    def stop(*_):
        trainer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    trainer.run()
