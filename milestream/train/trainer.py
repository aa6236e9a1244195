"""The trainer: collect groups from ``buffer.groups``, take a step, publish the new version.

  collect  batch_groups fresh groups; a stale one (current version - oldest token version > the
           staleness bound of run.schedule) is dropped onto buffer.dropped instead, as Miles does
  step     train/learner.py on the backend trainer.backend names (local, fsdp2, megatron)
  publish  the new weights on weights.versions, the step's figures on buffer.metrics
  persist  model + optimizer + RNG + consumed offsets, atomically, every checkpoint_every steps

Under torchrun (fsdp2, megatron) rank 0 alone talks to Kafka, Redis and the disk: it collects each
batch and broadcasts it; every rank computes the step.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from milestream.config import Config
from milestream.train import checkpoint
from milestream.train.collector import GroupCollector
from milestream.train.learner import CollectedGroup, Learner
from milestream.infra import faults
from milestream.infra.kafka import Admin, RecordProducer
from milestream.infra.lifecycle import stop_on_signals
from milestream.infra.model import configure_process
from milestream.schemas import topics
from milestream.schemas.codec import decode, encode
from milestream.schemas.records import GroupSample, Metrics
from milestream.streams import weights

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, stop: threading.Event | None = None):
        configure_process(cfg.model)
        self.cfg = cfg
        self.learner = Learner(cfg)
        self.leader = self.learner.backend.rank == 0
        self.state = self._resume()
        self.stop = stop or threading.Event()  # infra/lifecycle.py
        if self.leader:
            self.producer = RecordProducer(cfg.broker, client_id="trainer")
            self.sender = None if cfg.trainer.shadow else weights.make_sender(cfg)  # cfg.weights.transport
            self.collector = GroupCollector(cfg, self.producer, self.state.offsets,
                                            Admin(cfg.broker).partitions(topics.GROUPS), self.state.seen_groups,
                                            resumed=self.state.step > 0)
            # sync, one_step: the next batch is this version's (or newer); a shadow leaves admission to the live one
            if cfg.admission_lead is not None and not cfg.trainer.shadow:
                self.collector.ledger.raise_floor(self.state.version)

    def _resume(self) -> checkpoint.TrainerState:
        payload = checkpoint.load_latest(self.cfg.run.run_dir)
        if payload is None:
            return checkpoint.TrainerState()
        self.learner.load_state_dict(payload["backend"])
        state = checkpoint.restore(payload)
        log.info("resumed at step %d (version %d), offsets %s", state.step, state.version, state.offsets)
        return state

    def run(self) -> None:
        if self.cfg.weights.noise_check and self.state.version == 0:
            # the engines start from noise: the initial weights reach them as version 0 before they generate
            exported = self.learner.export_weights()  # collective: every rank
            if self.leader:
                self.announce(0, 0, exported)
        while self.state.step < self.cfg.trainer.steps and not self.stop.is_set():
            started = time.monotonic()
            batch = self.collect()
            if batch is None:  # the leader is stopping: so is every rank, in step
                self.stop.set()
                break
            collect_s = time.monotonic() - started  # waiting for rollout: the trainer's idle time
            faults.hold("trainer.collected")
            figures = self.learner.train_step(batch)
            self.state.step += 1
            self.state.version += 1
            exported = self.learner.export_weights()  # collective: every rank
            if self.leader:
                self.announce(self.state.version, self.state.step, exported)
                # published before the checkpoint: a checkpointed step's record is always on the log. A
                # step killed before its checkpoint is redone after resume and published again; the
                # later record of a step is the one of the run's lineage (log/lineage.py)
                self._publish_metrics(batch, {**figures, "step_s": time.monotonic() - started, "collect_s": collect_s})
                faults.hold("trainer.published")
            if self.state.step % self.cfg.trainer.checkpoint_every == 0 or self.state.step == self.cfg.trainer.steps:
                self.save()
        if self.stop.is_set() and self.state.step % self.cfg.trainer.checkpoint_every:
            self.save()
        if self.leader:
            self.producer.flush()
            self.collector.close()
            if self.sender is not None:
                self.sender.close()

    def announce(self, version: int, step: int, exported) -> None:
        """Publish a version, the ledger told first: readers refuse an announcement past the trainer's version. A
        shadow publishes none: the engines follow the live trainer."""
        if self.sender is None:
            return
        self.collector.ledger.raise_trainer_version(version)
        self.sender.publish(self.producer, version, step, exported)

    def collect(self) -> list[CollectedGroup] | None:
        """The next batch (None: stop), read by the leader and broadcast to every other rank."""
        batch = None
        if self.leader:
            taken = self.collector.take(self.cfg.trainer.batch_groups, self.state.version, self.stop.is_set)
            if taken is not None:
                batch = [CollectedGroup(group.group_id, group.samples, lag) for group, lag in taken]
        if self.learner.backend.world_size > 1:
            batch = broadcast_batch(batch if self.leader else None, self.leader)
        return batch

    def save(self) -> None:
        learner_state = self.learner.state_dict()  # collective: every rank
        if self.leader:
            self.state.offsets = self.collector.offsets()
            checkpoint.save(self.cfg.run.run_dir, self.state, learner_state, keep=self.cfg.trainer.keep_checkpoints)

    def _publish_metrics(self, batch: list[CollectedGroup], figures: dict[str, float]) -> None:
        lags = [g.staleness for g in batch]
        values = {**figures, "version": float(self.state.version), "member_pid": float(os.getpid()),  # its life
                  **self.collector.ledger.figures(self.state.version),
                  "staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
                  **self.collector.take_pool_figures(self.state.version), **self.collector.take_drop_figures(),
                  **self.collector.take_cost_figures()}
        source = f"shadow/{self.cfg.run_path.name}" if self.cfg.trainer.shadow else "trainer"  # none of the lineage
        record = Metrics(source, self.state.step, time.time(), values, [g.group_id for g in batch], lags)
        self.producer.send(topics.METRICS, [record], key=source)
        self.producer.flush()
        log.info("step %d reward %.3f loss %.4f staleness %.2f/%d queue %d (%.1fs)", self.state.step,
                 values["reward_mean"], values["loss"], values["staleness_mean"], max(lags), values["queue_size"],
                 figures["step_s"])


def broadcast_batch(batch: list[CollectedGroup] | None, leader: bool) -> list[CollectedGroup] | None:
    """The leader's batch on every rank, as Arrow bytes (never a pickle: the samples came from a topic);
    None (stop) travels as size -1. Each group's id and staleness ride on its samples' order."""
    size = torch.tensor([-1], dtype=torch.int64)
    payload = b""
    if leader and batch is not None:
        payload = encode([s for g in batch for s in g.samples])
        layout = json.dumps([[g.group_id, len(g.samples), g.staleness] for g in batch]).encode()
        payload = len(layout).to_bytes(8, "little") + layout + payload
        size[0] = len(payload)
    dist.broadcast(size, src=0)
    if size.item() < 0:
        return None
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if leader else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0)
    raw = data.numpy().tobytes()
    head = int.from_bytes(raw[:8], "little")
    samples, out = decode(raw[8 + head:], GroupSample), []
    for group_id, count, lag in json.loads(raw[8:8 + head]):
        out.append(CollectedGroup(group_id, samples[:count], lag))
        samples = samples[count:]
    return out


def run_trainer(cfg: Config) -> None:
    Trainer(cfg, stop_on_signals()).run()
