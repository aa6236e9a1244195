"""Exactly-once audit of a finished run, from its archived log and its last trainer checkpoint.

The trainer publishes a step's record before it checkpoints the step. A trainer killed in between
redoes the step after resuming from the checkpoint before it, and publishes it again; the metrics
topic has one partition, so the later record of a step is the one the surviving model was trained
on: the run's *lineage*. Against the lineage, every group that reached ``buffer.groups`` is exactly
one of: trained (once), dropped with a reason, or still waiting in the buffer when the run stopped
(not yet seen by the trainer's last checkpoint, at or past its offset). Anything else was lost.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from milestream.train import checkpoint
from milestream.log.archive import archived_messages
from milestream.schemas import topics
from milestream.schemas.records import Metrics


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
    missing_steps: list[int] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not (self.groups_lost or self.groups_duplicated or self.missing_steps)


def _records(run_dir: Path, spec: topics.TopicSpec):
    for partition, offset, records in archived_messages(run_dir, spec):
        for record in records:
            yield partition, offset, record


def lineage(run_dir: str | Path) -> tuple[dict[int, Metrics], int]:
    """The trainer's record of each step that the surviving model went through, and all step records."""
    steps: dict[int, Metrics] = {}
    records = 0
    for _, _, record in _records(Path(run_dir), topics.METRICS):
        if record.source == "trainer":
            steps[record.step] = record  # offset order: a redone step's later record wins
            records += 1
    return steps, records


def audit_run(run_dir: str | Path) -> Audit:
    run_dir = Path(run_dir)
    steps, records = lineage(run_dir)
    trained = collections.Counter(g for record in steps.values() for g in record.group_ids)
    dropped = {record.group_id for *_, record in _records(run_dir, topics.DROPPED)} - trained.keys()
    payload = checkpoint.load_latest(run_dir)
    state = checkpoint.restore(payload) if payload is not None else checkpoint.TrainerState()
    emitted: dict[str, tuple[int, int]] = {}
    for partition, offset, sample in _records(run_dir, topics.GROUPS):
        emitted.setdefault(sample.group_id, (partition, offset))  # a re-emission is the same group
    buffered = {g for g, (partition, offset) in emitted.items()
                if g not in state.seen_groups and offset >= state.offsets.get(partition, 0)}
    accounted = trained.keys() | dropped | buffered
    final = max(steps, default=0)
    return Audit(
        steps=len(steps), step_records=records, groups_emitted=len(emitted), groups_trained=len(trained),
        groups_dropped=len(dropped & emitted.keys()), groups_buffered=len(buffered - trained.keys() - dropped),
        groups_lost=sorted(emitted.keys() - accounted),
        groups_duplicated=sorted(g for g, n in trained.items() if n > 1),
        missing_steps=[s for s in range(1, final + 1) if s not in steps],
    )
