"""Exactly-once audit of a finished run, from its archived log and its last trainer checkpoint.

Against the trainer's lineage (``log/lineage.py``), every group that reached ``buffer.groups`` is
exactly one of: trained (once), dropped with a reason, or still waiting in the buffer when the run
stopped (not yet seen by the trainer's last checkpoint, at or past its offset). Anything else was
lost; a group both trained and dropped, or trained twice, is a failure too.

A run on a Kafka cluster has no archive: its log is the brokers' (``audit_run(run_dir, BrokerSource(cfg))``).
A record on ``deadletter`` is none of the run's (log/lineage.py): the audit reads past it. A record that
does not decode and is not dead-lettered fails the audit (RecordError): a stage met it and said nothing.

An audit that is not exact carries its evidence (``explain``): for each offending group, where each of its
records lies on every topic, and each decision on it — emitted, dropped, trained — with the life of the stage
that wrote it, its step and the trainer's version then, so a failure can be told after the run is gone.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from milestream.config import run_folder
from milestream.log.accounting import SOURCES
from milestream.log.lineage import BUFFERED, DROPPED, LOST, Lineage, dead_lettered, lineage_of
from milestream.log.reader import (ArchiveSource, LoggedMessage, LogSource, OnBadRecord, SkipBadRecords,
                                   read_archive, read_archive_fields)
from milestream.schemas import topics
from milestream.schemas.codec import RecordError
from milestream.schemas.records import Dropped, Metrics
from milestream.train import checkpoint
from milestream.train.collector import life_of


@dataclass(frozen=True)
class Audit:
    steps: int  # steps in the lineage
    step_records: int  # trainer step records on the log (a redone step is there twice)
    groups_emitted: int
    groups_trained: int
    groups_dropped: int
    groups_buffered: int  # waiting for the trainer when the run stopped
    groups_lost: list[str] = field(default_factory=list)
    groups_duplicated: list[str] = field(default_factory=list)  # trained more than once in the lineage
    groups_trained_and_dropped: list[str] = field(default_factory=list)
    missing_steps: list[int] = field(default_factory=list)
    evidence: dict[str, dict[str, Any]] = field(default_factory=dict)  # per offending group (``explain``)

    @property
    def exact(self) -> bool:
        return not (self.groups_lost or self.groups_duplicated or self.groups_trained_and_dropped
                    or self.missing_steps)

    @property
    def offending(self) -> list[str]:
        """The groups that make the audit inexact: lost, trained twice, trained and dropped."""
        return sorted({*self.groups_lost, *self.groups_duplicated, *self.groups_trained_and_dropped})


def archived_lineage(run_dir: str | Path) -> Lineage:
    """The lineage of an archived run (of buffer.groups only the group ids are read)."""
    letters = read_archive_fields(run_dir, topics.DEADLETTER, ["source_topic", "partition", "offset"],
                                  SkipBadRecords())
    dead = dead_lettered((r["source_topic"], r["partition"], r["offset"]) for m in letters for r in m.records)
    on_bad = _unless_dead_lettered(dead)
    messages = (m for spec in (topics.METRICS, topics.DROPPED) for m in read_archive(run_dir, spec, on_bad))
    lineage = lineage_of(m for m in messages if _position(m) not in dead)
    for message in read_archive_fields(run_dir, topics.GROUPS, ["group_id"], on_bad):
        if _position(message) not in dead:
            for record in message.records:
                lineage.observe_emission(record["group_id"], message.position)
    return lineage


def _position(message: LoggedMessage) -> tuple[str, int, int]:
    return message.topic, message.partition, message.offset


def _unless_dead_lettered(dead: set[tuple[str, int, int]]) -> OnBadRecord:
    def on_bad(error: RecordError) -> None:
        where = error.position
        if (where.topic, where.partition, where.offset) not in dead:
            raise error
    return on_bad


def audit_run(run_dir: str | Path, source: LogSource | None = None) -> Audit:
    """The audit of the run in ``run_dir`` (its checkpoints), its log read from ``source`` (default: the archive).
    RunFolderError when ``run_dir`` is no run's folder: an audit of nothing would find nothing wrong."""
    run_folder(run_dir)
    if source is None:
        lineage = archived_lineage(run_dir)
    else:
        specs = (topics.METRICS, topics.DROPPED, topics.GROUPS)
        source.prefetch((topics.DEADLETTER, *specs))
        dead = dead_lettered((d.source_topic, d.partition, d.offset)
                             for m in source.messages(topics.DEADLETTER) for d in m.records)
        lineage = lineage_of(m for spec in specs for m in source.messages(spec) if _position(m) not in dead)
    payload = checkpoint.load_latest(run_dir)
    fates = lineage.fates(checkpoint.restore(payload) if payload is not None else checkpoint.TrainerState())
    outcomes = collections.Counter(fates[g].outcome for g in lineage.emitted)
    audit = Audit(
        steps=len(lineage.steps), step_records=lineage.step_records, groups_emitted=len(lineage.emitted),
        groups_trained=len(lineage.training()), groups_dropped=outcomes[DROPPED], groups_buffered=outcomes[BUFFERED],
        groups_lost=sorted(g for g in lineage.emitted if fates[g].outcome == LOST),
        groups_duplicated=lineage.trained_twice(), groups_trained_and_dropped=lineage.trained_and_dropped(),
        missing_steps=lineage.missing_steps(),
    )
    if audit.exact:
        return audit
    evidence = explain(source or ArchiveSource(run_dir, SkipBadRecords()), audit.offending[:EXPLAINED])
    return replace(audit, evidence=evidence)


EXPLAINED = 20  # offending groups explained at most (each explanation is read from the whole log)


def explain(source: LogSource, group_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Per group: ``records``, where each of its records lies on every topic ("partition@offset"), and
    ``decisions``, each record that emitted, dropped or trained it: where, when (the broker's time, seconds),
    by which stage and which life of it (``life``: its pid; a trainer step record or drop names its own, any
    other record is given the life of its stage that was running when it was stamped), and a drop's reason,
    detail and trainer version, or a step's number, version and whether it is the lineage's."""
    wanted = set(group_ids)
    records: dict[str, dict[str, list[str]]] = {g: collections.defaultdict(list) for g in wanted}
    decisions: dict[str, list[dict[str, Any]]] = {g: [] for g in wanted}
    source.prefetch((topics.METRICS, *SOURCES, topics.GROUPS, topics.DROPPED))
    metrics = source.messages(topics.METRICS)
    lives = _lives(metrics)

    def decided(group_id: str, message: LoggedMessage, decision: str, stage: str, **facts: Any) -> None:
        when = message.timestamp_ms / 1000
        decisions[group_id].append({"decision": decision, "topic": message.topic,
                                    "at": f"{message.partition}@{message.offset}", "time": round(when, 3),
                                    "by": stage, "life": facts.pop("life", None) or _life_at(lives[stage], when),
                                    **facts})

    for spec in (*SOURCES, topics.GROUPS):
        for message in source.fields(spec, ("group_id",)):
            for group_id in {r["group_id"] for r in message.records} & wanted:
                records[group_id][spec.name].append(f"{message.partition}@{message.offset}")
                if spec is topics.GROUPS:
                    decided(group_id, message, "emitted", "processor")
    for message in source.messages(topics.DROPPED):
        for drop in (d for d in message.records if isinstance(d, Dropped) and d.group_id in wanted):
            records[drop.group_id][topics.DROPPED.name].append(f"{message.partition}@{message.offset}")
            decided(drop.group_id, message, "dropped", drop.dropped_by, life=life_of(drop.detail), reason=drop.reason,
                    detail=drop.detail, trainer_version=drop.trainer_version)
    steps = [(m, r) for m in metrics for r in m.records if isinstance(r, Metrics) and r.source == "trainer"]
    lineage_offsets = {r.step: m.offset for m, r in steps}  # offset order: a redone step's later record counts
    for message, step in steps:
        for group_id in set(step.group_ids) & wanted:
            records[group_id][topics.METRICS.name].append(f"{message.partition}@{message.offset}")
            decided(group_id, message, "trained", "trainer", life=_pid(step), step=step.step,
                    trainer_version=int(step.values.get("version", -1)),
                    in_lineage=lineage_offsets[step.step] == message.offset)
    return {g: {"records": dict(records[g]), "decisions": sorted(decisions[g], key=lambda d: d["time"])}
            for g in sorted(wanted)}


def _pid(record: Metrics) -> int | None:
    pid = record.values.get("member_pid")
    return None if pid is None else int(pid)


def _lives(metrics: list[LoggedMessage]) -> dict[str, list[tuple[float, int]]]:
    """Per stage, (first seen, pid) of each life that published figures on buffer.metrics, in time order."""
    first: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for message in metrics:
        for record in message.records:
            if isinstance(record, Metrics) and (pid := _pid(record)) is not None:
                first[record.source].setdefault(pid, min(record.ts, message.timestamp_ms / 1000))
    return collections.defaultdict(list, {stage: sorted((ts, pid) for pid, ts in pids.items())
                                          for stage, pids in first.items()})


def _life_at(lives: list[tuple[float, int]], when: float) -> int | None:
    """The pid of the newest life seen by ``when`` (a record made before a life's first figures is its
    predecessor's, or made before them: read the time against the stage's log)."""
    started = [pid for first, pid in lives if first <= when]
    return started[-1] if started else None
