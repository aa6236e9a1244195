"""Exactly-once audit of a finished run, from its archived log and its last trainer checkpoint.

Against the trainer's lineage (``log/lineage.py``), every group that reached ``buffer.groups`` is
exactly one of: trained (once), dropped with a reason, or still waiting in the buffer when the run
stopped (not yet seen by the trainer's last checkpoint, at or past its offset). Anything else was
lost; a group both trained and dropped, or trained twice, is a failure too.

A run on a Kafka cluster has no archive: its log is the brokers' (``audit_run(run_dir, BrokerSource(cfg))``).
A record on ``deadletter`` is none of the run's (log/lineage.py): the audit reads past it. A record that
does not decode and is not dead-lettered fails the audit (RecordError): a stage met it and said nothing.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from milestream.log.lineage import BUFFERED, DROPPED, LOST, Lineage, dead_lettered, lineage_of
from milestream.log.reader import (LoggedMessage, LogSource, OnBadRecord, SkipBadRecords, read_archive,
                                   read_archive_fields)
from milestream.schemas import topics
from milestream.schemas.codec import RecordError
from milestream.train import checkpoint


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

    @property
    def exact(self) -> bool:
        return not (self.groups_lost or self.groups_duplicated or self.groups_trained_and_dropped
                    or self.missing_steps)


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
    """The audit of the run in ``run_dir`` (its checkpoints), its log read from ``source`` (default: the archive)."""
    if source is None:
        lineage = archived_lineage(run_dir)
    else:
        dead = dead_lettered((d.source_topic, d.partition, d.offset)
                             for m in source.messages(topics.DEADLETTER) for d in m.records)
        specs = (topics.METRICS, topics.DROPPED, topics.GROUPS)
        lineage = lineage_of(m for spec in specs for m in source.messages(spec) if _position(m) not in dead)
    payload = checkpoint.load_latest(run_dir)
    fates = lineage.fates(checkpoint.restore(payload) if payload is not None else checkpoint.TrainerState())
    outcomes = collections.Counter(fates[g].outcome for g in lineage.emitted)
    return Audit(
        steps=len(lineage.steps), step_records=lineage.step_records, groups_emitted=len(lineage.emitted),
        groups_trained=len(lineage.training()), groups_dropped=outcomes[DROPPED], groups_buffered=outcomes[BUFFERED],
        groups_lost=sorted(g for g in lineage.emitted if fates[g].outcome == LOST),
        groups_duplicated=lineage.trained_twice(), groups_trained_and_dropped=lineage.trained_and_dropped(),
        missing_steps=lineage.missing_steps(),
    )
