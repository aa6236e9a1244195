"""Re-drive the stream processor and the trainer offline on a run's logged records, and compare.

Processor: the logged rollout records (``rollout.trajectories``, ``rollout.logprobs``,
``rollout.routing``) go through the broker-free group assembly and arrival drop rules of
``streams/groups.py``, with the run's ``buffer.filter`` and staleness bound (``cfg.staleness_bound``), in
broker timestamp order, interleaved with ``weights.versions`` (the newest version seen decides the stale
pre-drop, as in the live processor). Each group's offline outcome is compared with the logged one:
``emitted`` (on ``buffer.groups``; its manifest must then be identical to the logged one) or the
reason of a ``buffer.dropped`` record written by the processor. The live processor expires a group
still incomplete after ``buffer.incomplete_after_s`` of wall time; offline, a group still partial at
the end of the log (``partial``) agrees with a logged ``incomplete`` drop or with no outcome yet.
The stale pre-drop depends on when the live processor saw a version relative to a group's last
record, so a group completing within milliseconds of a version may legitimately differ; such a
disagreement is reported, never hidden.

Trainer: the logged steps A..B recomputed from the checkpoint before A (``step_replay.replay_steps``)
and compared bit for bit with the logged loss and gradient norm.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

from milestream.config import Config
from milestream.log.lineage import lineage_of
from milestream.log.reader import LoggedMessage, LogSource
from milestream.log.samples import logged_manifests, logged_samples
from milestream.observe.recompute import StepReplay, replay_steps
from milestream.schemas import topics
from milestream.schemas.records import GroupManifest
from milestream.streams.groups import GroupAssembler, load_filter, source_topics
from milestream.streams.sources import MismatchError, refs_of

EMITTED, PARTIAL, PENDING = "emitted", "partial", "pending"


@dataclass(frozen=True)
class ProcessorRedrive:
    offline: dict[str, str]  # group id -> emitted | drop reason | partial
    logged: dict[str, str]  # group id -> emitted | drop reason (by the processor) | pending
    differing_samples: list[str] = field(default_factory=list)  # emitted both ways, manifests not identical
    rejected: list[str] = field(default_factory=list)  # records the rules refused (the live one dead-letters them)

    @property
    def disagreements(self) -> list[tuple[str, str, str]]:
        """(group id, offline outcome, logged outcome) for every group whose outcomes differ."""
        return [(g, self.offline.get(g, PENDING), self.logged.get(g, PENDING))
                for g in sorted(self.offline.keys() | self.logged.keys())
                if not _agree(self.offline.get(g, PENDING), self.logged.get(g, PENDING))]

    @property
    def agrees(self) -> bool:
        return not self.disagreements and not self.differing_samples

    def summary(self) -> dict[str, object]:
        return {"groups": len(self.offline.keys() | self.logged.keys()), "offline": _count(self.offline),
                "logged": _count(self.logged), "agrees": self.agrees,
                "disagreements": [list(d) for d in self.disagreements], "differing_samples": self.differing_samples,
                "rejected": self.rejected}


def _agree(offline: str, logged: str) -> bool:
    return offline == logged or (offline == PARTIAL and logged in ("incomplete", PENDING))


def _count(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return dict(sorted(counts.items()))


def _in_time_order(source: LogSource, sources: tuple[topics.TopicSpec, ...]) -> list[LoggedMessage]:
    """Versions and rollout records merged by broker timestamp; each partition stays in offset order."""
    source.prefetch((topics.WEIGHT_VERSIONS, *sources))
    streams = [[m for m in source.messages(spec) if m.partition == p]
               for spec in (topics.WEIGHT_VERSIONS, *sources)
               for p in sorted({m.partition for m in source.messages(spec)})]
    # a version stamped in the same millisecond as a record counts as seen first (streams[0] wins ties)
    return list(heapq.merge(*streams, key=lambda m: m.timestamp_ms))


def logged_outcomes(source: LogSource) -> tuple[dict[str, str], dict[str, list[GroupManifest]]]:
    """Per group, what the live processor did; and the manifest of each emitted group (first emission)."""
    emitted = logged_manifests(source)
    outcomes = dict.fromkeys(emitted, EMITTED)
    for group_id, drop in lineage_of(source.messages(topics.DROPPED)).drops.items():
        if drop.dropped_by == "processor":
            outcomes[group_id] = drop.reason
    return outcomes, emitted


def redrive_processor(cfg: Config, source: LogSource) -> ProcessorRedrive:
    assembler = GroupAssembler(load_filter(cfg.buffer.filter), cfg.staleness_bound, cfg.distill.enabled)
    offline: dict[str, str] = {}
    manifests: dict[str, list[GroupManifest]] = {}
    rejected: list[str] = []
    for message in _in_time_order(source, source_topics(cfg.distill.enabled)):
        if message.topic == topics.WEIGHT_VERSIONS.name:
            assembler.latest_version = max([assembler.latest_version, *(r.version for r in message.records)])
            continue
        for record in message.records:
            offline.setdefault(record.group_id, PARTIAL)
        try:
            refs = refs_of(message.records, type(message.records[0]), message.partition, message.offset,
                           cfg.rollout.group_size)
            for ref in refs:
                outcome, _ = assembler.add(ref)
                if outcome is not None:
                    offline[outcome.group_id] = EMITTED if outcome.dropped is None else outcome.dropped.reason
                    manifests[outcome.group_id] = outcome.manifest
        except MismatchError as exc:
            rejected.append(f"{message.topic}[{message.partition}]@{message.offset}: field {exc.field}: {exc}")
    logged, emitted = logged_outcomes(source)
    differing = sorted(g for g in manifests.keys() & emitted.keys()
                       if offline[g] == logged.get(g) == EMITTED and manifests[g] != emitted[g])
    return ProcessorRedrive(offline, logged, differing, rejected)


def redrive_trainer(cfg: Config, run_dir: str | Path, source: LogSource, first: int, last: int) -> list[StepReplay]:
    """Steps ``first``..``last`` recomputed from the checkpoint before ``first`` (RUN_DIR/checkpoints)."""
    steps = lineage_of(source.messages(topics.METRICS)).steps

    return replay_steps(cfg, run_dir, steps, lambda wanted: logged_samples(source, wanted), first, last)
