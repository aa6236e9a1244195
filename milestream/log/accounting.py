"""The buffer ledger as the log tells it: one derivation for a run that lost its broker, its Redis, or both.

The ledger (streams/ledger.py) keeps credit + groups held = capacity. With every stage stopped, each
of its figures follows from the log: what entered the buffer (rollout.trajectories, .logprobs,
.routing), what left it (buffer.groups, buffer.dropped, the trainer's checkpoint: its offsets and the
groups it saw), where rollout stands on ``prompts`` (its consumer group's committed offsets) and how
far the prompt feeder got (the first attempts on ``prompts``). The log is read through
``log/reader.py``: the archive after the broker was lost (log/restore.py, which puts it back first),
the live broker's topics after Redis alone was lost.

``derive_accounting``  credit, queue, admissions and the trainer's version as the restarted stages must find them
``rebuild_ledger``     a fresh Redis written whole: those figures, plus every group with an outcome on
                       the log as settled, the processor's run totals, the feeder's position and the
                       trainer's drops
``rebuild_from_broker``  the latter for a run whose broker lives on (``milestream run`` after Redis died)

Nothing comes from a Redis snapshot: the embedded redis-server persists nothing (infra/services.py).
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milestream.config import Config
from milestream.infra.kafka import LogAdmin, topic_name
from milestream.log.lineage import TrainerPosition, dead_lettered
from milestream.log.reader import BrokerSource, LogSource, SkipBadRecords
from milestream.schemas import topics
from milestream.streams.groups import source_topics
from milestream.streams.ledger import BufferLedger, Reconciled, TrainerDrop

log = logging.getLogger(__name__)

# what the processor joins groups from (the teacher's topic holds records only under distill)
SOURCES = source_topics(teacher=True)
Row = tuple[int, int, str]  # (partition, offset, group id) of one record


def rollout_group(cfg: Config) -> str:
    """The rollout workers' consumer group on ``prompts`` (milestream.producers.worker names it so)."""
    return f"{cfg.broker.topic_prefix}rollout"


def trainer_position(run_dir: str | Path) -> TrainerPosition:
    """Where the trainer's last checkpoint stands (nothing read yet without one)."""
    from milestream.train import checkpoint  # torch: only a resume needs it

    payload = checkpoint.load_latest(run_dir)
    return checkpoint.restore(payload) if payload is not None else checkpoint.TrainerState()


@dataclass(frozen=True)
class Accounting:
    """The buffer's Redis counters as the restarted run must see them (see ``derive_accounting``)."""

    credit: int
    queued: dict[str, int]  # group id -> oldest token version, for the groups the trainer will read
    prompts_admitted: int
    held: int  # groups that will give a credit back without taking one
    in_flight: tuple[str, ...]  # of those, the groups admitted that the processor has yet to settle
    trainer_version: int  # the newest version announced on the log (``LoggedRun.trainer_version``)

    def reconciled(self, unsettled: tuple[str, ...] = ()) -> Reconciled:
        """These figures as the ledger is rewritten to them."""
        return Reconciled(self.credit, self.queued, self.prompts_admitted, unsettled, self.in_flight,
                          self.trainer_version)


@dataclass(frozen=True)
class LoggedRun:
    """What the log says about every group, read once: where its records lie and how it left."""

    prompts: dict[str, tuple[int, int]]  # group id -> its prompt's (partition, offset); one group per attempt
    first_attempts: int  # distinct prompts of the prompt stream on ``prompts``: the feeder's position
    sources: dict[str, list[Row]]  # source topic -> its records
    emitted: list[tuple[int, int, str, int]]  # buffer.groups: (partition, offset, group id, oldest version)
    drops: dict[str, dict[str, Any]]  # group id -> its first drop's reason and dropper
    trainer: TrainerPosition
    announced: int = 0  # the newest version on weights.versions

    @property
    def trainer_version(self) -> int:
        """The newest version the trainer announced as the log tells it: a version it raised in the ledger and
        then died before announcing (a step killed before its checkpoint) is none; the resumed trainer redoes it.
        Left in the ledger, the processor would pre-drop as stale groups that the resumed trainer trains."""
        return max(self.trainer.version, self.announced)

    @classmethod
    def read(cls, source: LogSource, trainer: TrainerPosition) -> "LoggedRun":
        """``source`` should skip what does not decode (``SkipBadRecords``); what a stage dead-lettered is
        passed over here: none of it entered or left the buffer."""
        source.prefetch((topics.DEADLETTER, topics.PROMPTS, *SOURCES, topics.GROUPS, topics.DROPPED,
                         topics.WEIGHT_VERSIONS))
        letters = source.fields(topics.DEADLETTER, ("source_topic", "partition", "offset"))
        dead = dead_lettered((d["source_topic"], d["partition"], d["offset"]) for m in letters for d in m.records)

        def fields(spec: topics.TopicSpec, names: tuple[str, ...]) -> list:
            return [m for m in source.fields(spec, names) if (m.topic, m.partition, m.offset) not in dead]

        prompts: dict[str, tuple[int, int]] = {}
        first: set[str] = set()
        for m in fields(topics.PROMPTS, ("prompt_id", "attempt")):
            for prompt in m.records:
                prompts[f"{prompt['prompt_id']}#{prompt['attempt']}"] = (m.partition, m.offset)  # Prompt.group_id
                if prompt["attempt"] == 0:
                    first.add(prompt["prompt_id"])
        sources = {spec.name: [(m.partition, m.offset, m.records[0]["group_id"]) for m in fields(spec, ("group_id",))]
                   for spec in SOURCES}
        emitted = []
        for m in fields(topics.GROUPS, ("group_id", "min_version")):
            oldest = min((sample["min_version"] for sample in m.records if sample["min_version"] >= 0), default=-1)
            emitted.append((m.partition, m.offset, m.records[0]["group_id"], oldest))
        drops: dict[str, dict[str, Any]] = {}
        for m in fields(topics.DROPPED, ("group_id", "reason", "dropped_by", "trainer_version")):
            for record in m.records:
                drops.setdefault(record["group_id"], record)  # the first drop wins (log/lineage.py)
        announced = max((v["version"] for m in fields(topics.WEIGHT_VERSIONS, ("version",)) for v in m.records),
                        default=0)
        return cls(prompts, len(first), sources, emitted, drops, trainer, announced)

    @property
    def entered(self) -> set[str]:
        return {group_id for *_, group_id in self.sources[topics.TRAJECTORIES.name]}

    @property
    def left(self) -> set[str]:
        """Groups with an outcome: each was settled by the processor. The trainer saw what it took or
        dropped, though a broker crash may have lost its buffer.groups record from the archive."""
        return {g for _, _, g, _ in self.emitted} | self.drops.keys() | self.trainer.seen_groups

    def trainer_drops(self) -> dict[str, TrainerDrop]:
        """The groups the trainer dropped, as it decided (streams/ledger.py: a later life drops them again)."""
        return {g: TrainerDrop(d["reason"], d["trainer_version"]) for g, d in self.drops.items()
                if d["dropped_by"] == "trainer"}

    def processor_totals(self) -> dict[str, int]:
        """The processor's run totals (streams/ledger.py) as far as the log tells: groups out, drops by reason."""
        drops = collections.Counter(f"dropped_{d['reason']}" for d in self.drops.values()
                                    if d["dropped_by"] == "processor")
        return {"groups_out": len({g for _, _, g, _ in self.emitted}), **drops}


def derive_accounting(cfg: Config, run: LoggedRun, rollout_offsets: dict[int, int],
                      prompts_published: int) -> Accounting:
    """Credit = capacity - groups that still hold one, from the log alone (every stage stopped).

    A group holds a credit from its admission until it leaves (taken or dropped stale by the
    trainer, or dropped by the processor). After a restart:
      (a) a group on buffer.groups at or past the trainer's checkpointed offset, not in its seen set,
          will be read and leave (again): it holds one;
      (b) a group whose prompt lies below rollout's committed offset (it will not be admitted again)
          and that has not left yet (no buffer.groups / buffer.dropped record) will be settled by the
          processor: it holds one;
      (c) a group whose prompt lies at or past that offset is read and admitted again. One with records
          on the log that has not left holds its credit as (b) does: the processor takes its records (a
          crash rolled its admission back, not its samples) and admission finds it readmitted, or settled
          (streams/ledger.py); one with none takes a new credit.
    The groups of (b) and (c) with records are the ledger's admitted groups; the feeder's admitted count
    is set so that published - admitted = the prompts rollout will admit afresh.
    """
    offsets, seen = run.trainer.offsets, run.trainer.seen_groups
    entered, left = run.entered, run.left
    to_collect = {g: oldest for p, o, g, oldest in run.emitted if o >= offsets.get(p, 0) and g not in seen}
    unread = {g for g, (p, o) in run.prompts.items() if o >= rollout_offsets.get(p, 0)}
    pending = entered - left
    held = len(to_collect) + len(pending)
    if held > cfg.buffer_capacity:
        log.warning("more groups hold a credit (%d) than the buffer's capacity (%d): rollout waits until they leave",
                    held, cfg.buffer_capacity)
    afresh = unread - entered - left
    return Accounting(cfg.buffer_capacity - held, to_collect, max(0, prompts_published - len(afresh)), held,
                      tuple(sorted(pending)), run.trainer_version)


def rebuild_ledger(cfg: Config, run: LoggedRun, rollout_offsets: dict[int, int]) -> Accounting:
    """Write a fresh Redis's ledger whole from the log; call with every stage stopped."""
    accounting = derive_accounting(cfg, run, rollout_offsets, run.first_attempts)
    BufferLedger(cfg).rebuild(accounting.reconciled(), settled=run.left, totals=run.processor_totals(),
                              prompts_published=run.first_attempts, trainer_drops=run.trainer_drops())
    log.info("rebuilt the buffer ledger from the log: %s; %d groups settled, the feeder at %d", accounting,
             len(run.left), run.first_attempts)
    return accounting


def rebuild_from_broker(cfg: Config, run_dir: str | Path) -> Accounting:
    """Redis was lost, the broker lives: its topics and rollout's committed offsets are the whole log."""
    committed = LogAdmin(cfg.broker).committed(rollout_group(cfg))
    prompts = topic_name(cfg.broker, topics.PROMPTS)
    rollout_offsets = {partition: offset for (topic, partition), offset in committed.items() if topic == prompts}
    source = BrokerSource(cfg, on_bad=SkipBadRecords())
    return rebuild_ledger(cfg, LoggedRun.read(source, trainer_position(run_dir)), rollout_offsets)
