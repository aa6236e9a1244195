"""Replay an archived run: put its records back into a (fresh) broker, and resume the run from them.

``republish``  every archived topic-partition, in offset order, into the same partition of the same
               topic, with the same key, headers, timestamp and value bytes. A fresh broker assigns
               offsets densely from 0 (checked on tansu), so every record lands at its archived
               offset; each delivery is checked and a mismatch is an error (the broker was not empty,
               or the archive has a gap). Then the consumer groups' committed offsets, which lived in
               the lost broker, are committed again from the archive's snapshot.
``reconcile``  the buffer's credit and queue counters in Redis, re-derived from the archive, the
               trainer's checkpoint and the restored offsets, so that the restarted stages neither
               leak credit (prompts that rollout re-admits) nor hand it out twice (groups the trainer
               collects again after its checkpoint); the whole ledger when Redis was lost as well.
               The derivation is log/accounting.py's, shared with a run that lost only its Redis.
``resume``     both: what a run does after its broker restarted, before its stages start again.

What "resume" guarantees. Every offset a stage keeps outside the broker stays valid, because each
record comes back at its archived offset: the trainer seeks to its checkpointed buffer.groups
offsets and skips the groups in its checkpoint; the processor restarts from its restored committed
offsets and its settled groups in Redis; rollout re-admits the prompts above its restored committed
offset (a group half-published by a killed worker is generated again under the same ids, and the
processor de-duplicates its samples); the prompt feeder continues from its position in Redis. After a
planned restart (stages stopped, archiver drained, then the broker restarted) no record and no group
is lost. After a broker crash the records in the archive's unflushed tail (see ``archive``) are lost; a
trainer checkpoint past the archived buffer.groups is rolled back to the newest one the archive covers
(``trainer_within_archive``), and ``reconcile`` refuses to resume when there is none, rather than let
the trainer skip new groups. Republish into an empty broker only: one that already
holds records fails the offset check (restart it again and re-run).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from milestream.config import Config
from milestream.infra.kafka import LogAdmin, RecordProducer, commit_offsets, produce_raw
from milestream.log import accounting
from milestream.log.accounting import Accounting, LoggedRun, derive_accounting, rebuild_ledger, trainer_position
from milestream.log.lineage import TrainerPosition
from milestream.log.archive import ArchiveState, archived_raw, load_manifest, segment_paths
from milestream.log.reader import ArchiveSource, SkipBadRecords, read_archive_fields
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger

log = logging.getLogger(__name__)


class ReplayError(RuntimeError):
    pass


@dataclass
class Republished:
    records: dict[str, int] = field(default_factory=dict)  # per topic
    ends: dict[str, dict[int, int]] = field(default_factory=dict)  # per topic-partition: next offset
    groups: dict[str, dict[str, dict[int, int]]] = field(default_factory=dict)  # committed again
    mismatches: list[str] = field(default_factory=list)


def target_config(cfg: Config, run_dir: str | Path, prefix: str | None = None) -> Config:
    """``cfg`` pointing at the archived run's topics (its own prefix unless ``prefix`` is given)."""
    chosen = load_manifest(run_dir)["topic_prefix"] if prefix is None else prefix
    return cfg.with_overrides(broker={"topic_prefix": chosen})


def create_topics(cfg: Config, manifest: dict[str, Any]) -> None:
    """The archived topics with their archived partition counts (an existing one must match)."""
    admin = LogAdmin(cfg.broker)
    existing = admin.list_topics()
    shapes = {cfg.broker.topic_prefix + name: (shape["partitions"], shape["max_message_bytes"])
              for name, shape in manifest["topics"].items()}
    for full, (partitions, _) in shapes.items():
        if full in existing and existing[full] != partitions:
            raise ReplayError(f"topic {full} has {existing[full]} partitions, the archive {partitions}")
    admin.create_shaped(shapes)


def _check_delivery(report: Republished, topic: str, partition: int, expected: int, err, landed: int) -> None:
    if err is not None:
        report.mismatches.append(f"{topic}[{partition}]@{expected}: not delivered: {err}")
    elif landed != expected:
        report.mismatches.append(f"{topic}[{partition}]: archived offset {expected} landed at {landed}")


def _republish_topic(producer: RecordProducer, cfg: Config, run_dir: Path, name: str, report: Republished) -> None:
    """One topic, segment by segment (segments are in time order, rows in partition-offset order)."""
    full = cfg.broker.topic_prefix + name
    ends = report.ends.setdefault(name, {})
    for message in archived_raw(run_dir, name):
        partition, offset = message.partition, message.offset
        expected = ends.get(partition, 0)
        if offset < expected:
            continue  # archived twice (cannot happen after recover(); harmless to skip)
        if offset > expected:
            raise ReplayError(f"archive of {name}[{partition}] has a gap: offset {offset} follows {expected - 1}; "
                              "republished offsets could not match the archived ones")
        produce_raw(producer, full, message, functools.partial(_check_delivery, report, name, partition, offset))
        ends[partition] = offset + 1
        report.records[name] = report.records.get(name, 0) + 1


def republish(cfg: Config, run_dir: str | Path, prefix: str | None = None, restore_groups: bool = True) -> Republished:
    """Put the archived run back into the broker ``cfg`` names; raises ReplayError unless exact."""
    run_dir = Path(run_dir)
    manifest = load_manifest(run_dir)
    cfg = target_config(cfg, run_dir, prefix)
    create_topics(cfg, manifest)
    producer = RecordProducer(cfg.broker, client_id="milestream-replay")
    report = Republished()
    for name in manifest["topics"]:
        _republish_topic(producer, cfg, run_dir, name, report)
    try:
        producer.flush(120)
    except TimeoutError as exc:
        raise ReplayError(str(exc)) from None
    if report.mismatches:
        raise ReplayError(f"{len(report.mismatches)} records did not land at their archived offsets (was the "
                          f"broker fresh?): {report.mismatches[:5]}")
    if restore_groups:
        state = ArchiveState.load(run_dir)
        report.groups = restore_group_offsets(cfg, state, report.ends, manifest["topic_prefix"])
    log.info("republished %d records of %d topics; restored %d consumer groups",
             sum(report.records.values()), len(report.records), len(report.groups))
    return report


def restore_group_offsets(cfg: Config, state: ArchiveState, ends: dict[str, dict[int, int]],
                          archived_prefix: str) -> dict[str, dict[str, dict[int, int]]]:
    """Commit every snapshotted group's offsets again (before its members start).

    An offset past the republished end (a snapshot newer than the last flushed segment, after a
    crash) is clamped to the end: the consumer then waits there instead of resetting to the start.
    """
    restored: dict[str, dict[str, dict[int, int]]] = {}
    for group, per_topic in state.groups.items():
        if archived_prefix and group.startswith(archived_prefix):
            group = cfg.broker.topic_prefix + group[len(archived_prefix):]
        offsets = {}
        for name, parts in per_topic.items():
            for partition, offset in parts.items():
                end = ends.get(name, {}).get(partition, 0)
                if offset > end:
                    log.warning("group %s: %s[%d] committed %d, archive ends at %d; clamped", group, name,
                                partition, offset, end)
                offsets[(cfg.broker.topic_prefix + name, partition)] = min(offset, end)
                restored.setdefault(group, {}).setdefault(name, {})[partition] = min(offset, end)
        commit_offsets(cfg.broker, group, offsets)
    return restored


def archived_trainer_steps(run_dir: str | Path) -> set[int]:
    """The steps whose trainer record (buffer.metrics) the archive holds."""
    metrics = read_archive_fields(run_dir, topics.METRICS, ("source", "step"), SkipBadRecords())
    return {r["step"] for m in metrics for r in m.records if r["source"] == "trainer"}


def covered_checkpoints(run_dir: str | Path, ends: dict[int, int]) -> list[int]:
    """The trainer's checkpoints, oldest first, that the archive covers: it holds the buffer.groups records up to
    the checkpoint's offsets (``ends``: the archived buffer.groups ends) and the record of each step up to it.
    The trainer publishes a step's record before checkpointing it, but the archiver reads topics at their own
    pace: a checkpoint whose groups it has can still lack the step's record, which a resume there never writes
    again (the run's lineage would miss the step)."""
    from milestream.train import checkpoint  # torch: only a resume needs it

    folders, latest, recorded = checkpoint.saved(run_dir), checkpoint.latest_step(run_dir), archived_trainer_steps(run_dir)
    return [step for step, folder in folders.items()
            if step <= latest and not past_archive(folder, ends) and recorded.issuperset(range(1, step + 1))]


def past_archive(folder: Path, ends: dict[int, int]) -> dict[int, tuple[int, int]]:
    """partition -> (checkpoint offset, archive end) where the checkpoint at ``folder`` read past the archive."""
    from milestream.train import checkpoint

    return {p: (o, ends.get(p, 0)) for p, o in checkpoint.saved_offsets(folder).items() if o > ends.get(p, 0)}


def trainer_within_archive(run_dir: str | Path, ends: dict[int, int]) -> TrainerPosition:
    """The trainer's newest checkpoint the archive covers (``covered_checkpoints``), made the latest.

    A broker crash loses the archive's unflushed tail (more while the archiver was down). A checkpoint past
    that tail trained groups the log no longer has: resumed, the trainer would skip the new groups written at
    those offsets, and the run's lineage would miss the steps it took. So the trainer goes back to the newest
    checkpoint the archive covers and redoes the steps after it, as after its own kill between checkpoints;
    the newer checkpoints are deleted. Refused when no checkpoint is covered (a fresh start would redo the run)."""
    from milestream.train import checkpoint

    folders, latest = checkpoint.saved(run_dir), checkpoint.latest_step(run_dir)
    covered = covered_checkpoints(run_dir, ends)
    if latest and not covered:  # the trainer would skip the first new groups at those offsets: refuse, loudly
        raise ReplayError(f"no checkpoint of the trainer is covered by the archive: the latest read buffer.groups "
                          f"past it (partition: (checkpoint, archive end)) {past_archive(folders[latest], ends)} or "
                          f"its step records are missing; the broker was lost before the archive caught up")
    if latest and covered[-1] != latest:
        deleted = checkpoint.roll_back(run_dir, covered[-1])
        log.warning("the trainer's checkpoints of steps %s are past the archive (their groups or step records were "
                    "lost with the broker): it resumes from step %d and redoes the steps after it", deleted, covered[-1])
    return trainer_position(run_dir)


def reconcile(cfg: Config, run_dir: str | Path, report: Republished, rollout_group: str | None = None,
              fresh_ledger: bool = False) -> Accounting:
    """Write the counters derived from the archive (log/accounting.py) to Redis; call with every stage
    stopped, after ``republish``. ``fresh_ledger``: Redis was lost too (or started empty), so every key
    of the ledger is written, not only those a surviving Redis gets wrong."""
    trainer = trainer_within_archive(run_dir, report.ends.get(topics.GROUPS.name, {}))
    restored = report.groups
    rollout_offsets = restored.get(rollout_group or accounting.rollout_group(cfg), {}).get(topics.PROMPTS.name, {})
    run = LoggedRun.read(ArchiveSource(run_dir, SkipBadRecords()), trainer)
    unsettled = rewind_processor(cfg, run, restored)
    if fresh_ledger:
        return rebuild_ledger(cfg, run, rollout_offsets)
    ledger = BufferLedger(cfg)
    figures = derive_accounting(cfg, run, rollout_offsets, ledger.prompts_published())
    ledger.reconcile(figures.reconciled(tuple(unsettled)))
    log.info("reconciled the buffer: %s; %d groups the processor settled have no archived outcome", figures,
             len(unsettled))
    return figures


def rewind_processor(cfg: Config, run: LoggedRun, restored: dict[str, dict[str, dict[int, int]]]) -> list[str]:
    """After a broker crash, make the processor redo every group whose outcome the archive lacks.

    The processor may have settled a group, and committed past its records, whose buffer.groups or
    buffer.dropped record the archiver had not yet written when the broker died. Such a group is
    forgotten as settled, and the processor's committed offset of each source partition moves back
    to the oldest record of any group without an archived outcome, so it is read and emitted again.
    After a planned restart nothing moves: those records all lie past the committed offsets.
    Returns the group ids forgotten as settled.
    """
    from milestream.streams.processor import app_id

    group = app_id(cfg)
    committed = restored.get(group, {})
    rewound: dict[tuple[str, int], int] = {}
    entered: set[str] = set()
    left = run.left
    for spec in accounting.SOURCES:
        oldest: dict[int, int] = {}
        for partition, offset, group_id in run.sources[spec.name]:
            entered.add(group_id)
            if group_id not in left:
                oldest[partition] = min(offset, oldest.get(partition, offset))
        for partition, offset in oldest.items():
            if offset < committed.get(spec.name, {}).get(partition, 0):
                rewound[(cfg.broker.topic_prefix + spec.name, partition)] = offset
                committed.setdefault(spec.name, {})[partition] = offset
    if rewound:
        log.warning("the processor's committed offsets move back to %s: groups without an archived outcome", rewound)
        commit_offsets(cfg.broker, group, rewound)
    sent = BufferLedger(cfg).settled_or_sending()
    return sorted(g for g in sent if g in entered and g not in left)


def resume(cfg: Config, run_dir: str | Path, prefix: str | None = None,
           fresh_ledger: bool = False) -> tuple[Republished, Accounting]:
    """After a broker restart, before the stages start again: republish, restore groups, reconcile
    (``fresh_ledger``: on a Redis that holds nothing of the run, see ``reconcile``)."""
    live = target_config(cfg, run_dir, prefix)
    report = republish(live, run_dir, prefix=live.broker.topic_prefix)
    return report, reconcile(live, run_dir, report, fresh_ledger=fresh_ledger)


def describe(run_dir: str | Path) -> dict[str, Any]:
    """What the archive holds: per topic, records and next offset per partition; the groups."""
    state = ArchiveState.load(run_dir)
    manifest = load_manifest(run_dir)
    return {"topic_prefix": manifest["topic_prefix"],
            "topics": {name: {"partitions": shape["partitions"], "segments": len(segment_paths(run_dir, name)),
                              "next_offsets": state.offsets.get(name, {})}
                       for name, shape in manifest["topics"].items()},
            "groups": state.groups}
