"""What became of a run's steps and groups, as its log tells it: the one place these rules live.

**Trainer lineage.** The trainer publishes a step's record before it checkpoints the step. A trainer
killed in between redoes the step after resuming from the checkpoint before it, and publishes it
again; buffer.metrics has one partition, so in offset order the later record of a step is the one the
surviving model was trained on. The lineage is that record of each step.

**Drops.** A group can be dropped more than once: a processor that restarts before settling re-sends its
drop (as the first life decided it: streams/ledger.py keeps that outcome, so a later life never drops a
group an earlier one emitted), and a trainer resumed from a checkpoint before its drop drops the group
again, as the dead life decided (streams/ledger.py keeps the trainer's drops too: its steps are redone, the
resumed life at an older version would train the group, and the dead life's drop is on the log already).
The first drop of a group wins (see ``Lineage.observe``).

**Group fate.** Against the lineage, a group is ``trained`` (a lineage step trained it), else
``dropped`` (on buffer.dropped), else, when it is on buffer.groups, ``buffered`` (still waiting for
the trainer when the log ends) or ``lost``. Given the trainer's last checkpoint, a group is buffered
only if the checkpoint had not seen it and it lies at or past the checkpoint's buffer.groups offset;
without one, every emitted group without an outcome is buffered. A group both trained and dropped is
trained, and reported by ``trained_and_dropped``: the audit fails on it.

``Lineage`` is fed records one at a time, so a finished log (audit, inspection, recompute, redrive)
and a live feed (the metrics series, the run monitor) share it; feed each topic in offset order.

**What counts.** A record that does not decode, or that breaks ``check_observed`` (a trainer step
record without its figures or past the run's steps, a drop no stage could have written), is none of
the run's: the run monitor dead-letters it, and a finished log's lineage skips every record that lies
on ``deadletter`` (``dead_lettered``).
"""
from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from milestream.log.reader import LoggedMessage
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Dropped, EvalResult, GroupManifest, Metrics, Record

TRAINED, DROPPED, BUFFERED, LOST = "trained", "dropped", "buffered", "lost"


class TrainerPosition(Protocol):
    """Where the trainer's last checkpoint stands on buffer.groups (``train.checkpoint.TrainerState``)."""

    offsets: dict[int, int]  # partition -> next offset to read
    seen_groups: set[str]  # trained or dropped by the trainer
    version: int  # the weight version it had made


@dataclass(frozen=True)
class GroupFate:
    outcome: str  # trained | dropped | buffered | lost
    step: int | None = None  # the lineage step that trained it
    staleness: int | None = None  # its staleness in that step
    drop: Dropped | None = None  # the drop that counts (the first)
    emitted_at: tuple[int, int] | None = None  # its first buffer.groups record: (partition, offset)


@dataclass
class Lineage:
    steps: dict[int, Metrics] = field(default_factory=dict)  # the lineage: each step's record that counts
    step_records: int = 0  # trainer step records seen (a redone step is there twice)
    drops: dict[str, Dropped] = field(default_factory=dict)  # each dropped group's first drop
    emitted: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> its first buffer.groups record

    def observe(self, record: Record, at: Position) -> None:
        """One record of buffer.metrics, buffer.dropped or buffer.groups (others are ignored).

        Drops: the first wins. It is when and why the group left the loop: its credit came back then,
        and nothing of a later drop reached the trainer. A later drop is an echo of a re-delivered input;
        letting it win would move the drop to a restart's time and change its reason or dropper after
        the fact, so a live monitor and the finished log would disagree on what was already counted.
        """
        if isinstance(record, Metrics) and record.source == "trainer":
            self.steps[record.step] = record  # offset order: a redone step's later record wins
            self.step_records += 1
        elif isinstance(record, Dropped):
            self.drops.setdefault(record.group_id, record)
        elif isinstance(record, GroupManifest):
            self.observe_emission(record.group_id, at)

    def observe_emission(self, group_id: str, at: Position) -> None:
        """A buffer.groups record of ``group_id``, for a reader that decodes only group ids."""
        self.emitted.setdefault(group_id, (at.partition, at.offset))  # a re-emission is the same group

    def drop_reasons(self) -> dict[str, int]:
        """Dropped groups per reason, each group once."""
        return dict(collections.Counter(d.reason for d in self.drops.values()))

    def trainer_steps(self) -> list[Metrics]:
        return [self.steps[step] for step in sorted(self.steps)]

    def training(self) -> dict[str, list[tuple[int, int | None]]]:
        """Per trained group, (step, staleness) of every lineage step that trained it (one, unless duplicated)."""
        out: dict[str, list[tuple[int, int | None]]] = {}
        for record in self.trainer_steps():
            lags = record.group_staleness[:len(record.group_ids)]  # missing figures: the groups still count
            for group_id, lag in itertools.zip_longest(record.group_ids, lags):
                out.setdefault(group_id, []).append((record.step, lag))
        return out

    def trained_twice(self) -> list[str]:
        return sorted(g for g, steps in self.training().items() if len(steps) > 1)

    def trained_and_dropped(self) -> list[str]:
        return sorted(self.training().keys() & self.drops.keys())

    def missing_steps(self) -> list[int]:
        return [s for s in range(1, max(self.steps, default=0) + 1) if s not in self.steps]

    def fates(self, trainer: TrainerPosition | None = None) -> dict[str, GroupFate]:
        """The fate of every group the log names as emitted, dropped or trained (see the module docstring)."""
        training = self.training()
        fates = {}
        for group_id in self.emitted.keys() | self.drops.keys() | training.keys():
            at = self.emitted.get(group_id)
            if group_id in training:
                step, lag = training[group_id][-1]
                fates[group_id] = GroupFate(TRAINED, step, lag, emitted_at=at)
            elif group_id in self.drops:
                fates[group_id] = GroupFate(DROPPED, drop=self.drops[group_id], emitted_at=at)
            else:
                fates[group_id] = GroupFate(BUFFERED if _waiting(group_id, at, trainer) else LOST, emitted_at=at)
        return fates


def _waiting(group_id: str, at: tuple[int, int], trainer: TrainerPosition | None) -> bool:
    """Whether an emitted group without an outcome was still to be read by the trainer."""
    if trainer is None:
        return True
    partition, offset = at
    return group_id not in trainer.seen_groups and offset >= trainer.offsets.get(partition, 0)


# what a step line, summary.json and the plot read of a trainer step record
STEP_FIGURES = ("reward_mean", "staleness_mean", "staleness_max", "queue_size", "loss", "step_s", "version")
DROPPERS = ("processor", "trainer")


def check_observed(record: Record, position: Position, steps: int, batch_groups: int,
                   sent: Callable[[str], bool], evaluates: bool) -> None:
    """Raise RecordError naming the field of a buffer.metrics, buffer.dropped or eval.results record no
    stage of this run writes. ``sent(group_id)``: whether the processor sent the group (the ledger's
    settlements); ``evaluates``: whether the run evaluates (eval.mode)."""
    def bad(field_name: str, reason: str) -> RecordError:
        return RecordError(position, field_name, reason)

    if isinstance(record, Metrics):
        if not record.source or not record.source.isprintable() or record.step < 0 or not math.isfinite(record.ts):
            raise bad("source", f"source {record.source!r}, step {record.step}, ts {record.ts}")
        if record.source == "trainer":
            _check_step(record, steps, batch_groups, sent, bad)
    elif isinstance(record, Dropped):
        if record.dropped_by not in DROPPERS:
            raise bad("dropped_by", f"{record.dropped_by!r} is none of {DROPPERS}")
        if not record.reason.isidentifier() or record.num_samples < 0:
            raise bad("reason", f"reason {record.reason!r}, {record.num_samples} samples")
        if not sent(record.group_id):
            raise bad("group_id", f"the processor never sent group {record.group_id!r}")
    elif isinstance(record, EvalResult):
        if not evaluates:
            raise bad("name", "the run evaluates nothing (eval.mode null)")
        if record.status not in ("ok", "skipped") or min(record.version, record.step, record.lag_steps) < 0:
            raise bad("status", f"status {record.status!r}, version {record.version}, step {record.step}")
        if record.status == "ok" and not math.isfinite(record.score):
            raise bad("score", f"score {record.score}")


def _check_step(record: Metrics, steps: int, batch_groups: int, sent: Callable[[str], bool],
                bad: Callable[[str, str], RecordError]) -> None:
    if not 1 <= record.step <= steps:
        raise bad("step", f"trainer step {record.step} of a run of {steps}")
    missing = [name for name in STEP_FIGURES if name not in record.values]
    if missing:
        raise bad("values", f"a trainer step without {missing}")
    ids = record.group_ids
    if len(ids) != batch_groups or len(set(ids)) != len(ids) or len(record.group_staleness) != len(ids):
        raise bad("group_ids", f"{len(ids)} groups ({len(set(ids))} distinct), {len(record.group_staleness)} "
                  f"staleness figures; a step trains {batch_groups}")
    if unsent := [g for g in ids if not sent(g)]:
        raise bad("group_ids", f"groups the processor never sent: {unsent[:3]}")


def dead_lettered(letters: Iterable[tuple[str, int, int]]) -> set[tuple[str, int, int]]:
    """(catalogue topic, partition, offset) of each dead letter's (full topic, partition, offset): the
    records none of the run's."""
    names = sorted((spec.name for spec in topics.CATALOGUE), key=len, reverse=True)
    return {(next((n for n in names if topic.endswith(n)), topic), partition, offset)
            for topic, partition, offset in letters}


def lineage_of(messages: Iterable[LoggedMessage[Record]]) -> Lineage:
    """The lineage of finished log messages, each topic in offset order."""
    lineage = Lineage()
    for message in messages:
        for record in message.records:
            lineage.observe(record, message.position)
    return lineage
