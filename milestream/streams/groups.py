"""Group assembly and the arrival drop rules, free of any broker so they can be tested alone.

The assembler joins refs (streams/sources.py: a record's small fields and where it lies), never payloads.
A group is complete when every sample has its trajectories (one, or an agent's episode as many as it
declares: ``Trajectory.leaves``), each its log-probs, when its engine recorded MoE
routing (``Trajectory.routing_chunks`` > 0) every routing chunk, and under on-policy distillation
(``distill``) its teacher's log-probs. Records may arrive in any order and are
de-duplicated by (trajectory, chunk), so a re-read (after a restart) or a duplicate publish is harmless. Every
record of a group lies in one partition number (all are keyed by the group id), so one processor, the one
holding that partition, assembles it.

A complete group leaves as its manifest (one ``GroupManifest`` per sample: schemas/records.py), or dropped:
when a sample failed (status ``error``: the engine or a rollout layer raised), then, in Miles' order, when a
sample was aborted, when a sample's reward failed (``reward_error``), when the user filter (given the
manifest) rejects it, or (a pre-drop) when it is already past the staleness window of the latest version.

``join_sample`` is the other half: the trainer's sample from the records a manifest points at.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from milestream.config import import_path
from milestream.schemas import topics
from milestream.schemas.records import (Dropped, GroupManifest, GroupSample, LogProbs, Record, Routing, TeacherLogProbs,
                                        Trajectory, episode_mean)
from milestream.schemas.routing import joined_fields
from milestream.streams.sources import LogProbsRef, MismatchError, RoutingRef, SourceRef, TrajectoryRef


def source_topics(teacher: bool) -> tuple[topics.TopicSpec, ...]:
    """The topics a group is joined from; ``teacher``: on-policy distillation is on."""
    return (topics.TRAJECTORIES, topics.LOGPROBS, topics.ROUTING) + ((topics.TEACHER_LOGPROBS,) if teacher else ())


GroupFilter = Callable[[Sequence[GroupManifest]], tuple[bool, str]]
Versioned = TrajectoryRef | GroupManifest  # what carries a sample's min_version


def load_filter(path: str | None) -> GroupFilter | None:
    """``package.module:function`` (or ``package.module.function``) -> the function."""
    return import_path(path, "buffer.filter") if path else None


def oldest_version(samples: Sequence[Versioned]) -> int | None:
    """The oldest weight version of any token in the group; a group is never fresher than it."""
    versions = [s.min_version for s in samples if s.min_version >= 0]
    return min(versions) if versions else None


def staleness(samples: Sequence[Versioned], current_version: int) -> int:
    oldest = oldest_version(samples)
    return 0 if oldest is None else current_version - oldest


@dataclass
class PartialGroup:
    """A group's records so far, each kind keyed by trajectory id (a sample is one trajectory, or an agent's
    episode several: its ``leaves``)."""

    group_size: int
    partition: int
    needs_teacher: bool = False
    trajectories: dict[str, TrajectoryRef] = field(default_factory=dict)
    logprobs: dict[str, LogProbsRef] = field(default_factory=dict)
    teacher: dict[str, LogProbsRef] = field(default_factory=dict)
    routing: dict[str, dict[int, RoutingRef]] = field(default_factory=dict)  # trajectory -> chunk -> ref
    handles: list[Any] = field(default_factory=list)  # source messages, let go when the group leaves
    first_seen: float = field(default_factory=time.monotonic)

    def complete(self) -> bool:
        held = self.trajectories.keys()
        return (self._every_leaf() and self.logprobs.keys() == held
                and (not self.needs_teacher or self.teacher.keys() == held)
                and all(len(self.routing.get(tid, {})) == t.routing_chunks for tid, t in self.trajectories.items()))

    def _every_leaf(self) -> bool:
        """Every sample's trajectories are here: as many as its leaves."""
        per_sample: dict[int, int] = {}
        for t in self.trajectories.values():
            per_sample[t.sample_index] = per_sample.get(t.sample_index, 0) + 1
        return len(per_sample) == self.group_size and all(
            per_sample[t.sample_index] == t.leaves for t in self.trajectories.values())

    def has(self, ref: SourceRef) -> bool:
        if isinstance(ref, RoutingRef):
            return ref.chunk_index in self.routing.get(ref.trajectory_id, {})
        return ref.trajectory_id in self._held(ref)

    def _held(self, ref: TrajectoryRef | LogProbsRef) -> dict:
        if isinstance(ref, TrajectoryRef):
            return self.trajectories
        return self.teacher if ref.teacher else self.logprobs

    def check(self, ref: SourceRef) -> None:
        """Raise MismatchError when the record contradicts what the group already holds."""
        if ref.group_size != self.group_size or not 0 <= ref.sample_index < self.group_size:
            raise MismatchError("group_size", f"group {ref.group_id}: sample {ref.sample_index} of "
                                f"{ref.group_size} does not fit a group of {self.group_size}")
        if ref.at[0] != self.partition:
            raise MismatchError("group_id", f"group {ref.group_id} lies in partition {self.partition}, this record "
                                f"in {ref.at[0]}: not keyed by its group id")
        self._check_lengths(ref)
        if isinstance(ref, TrajectoryRef):
            self._check_leaves(ref)
        expected = self._routing_chunks(ref.trajectory_id)
        if isinstance(ref, TrajectoryRef):
            declared = ref.routing_chunks
        elif isinstance(ref, RoutingRef):
            declared = ref.num_chunks
        else:
            return
        if expected is not None and declared != expected:
            raise MismatchError("num_chunks" if isinstance(ref, RoutingRef) else "routing_chunks",
                                f"group {ref.group_id} trajectory {ref.trajectory_id}: {declared} routing chunks "
                                f"declared, {expected} by the records before")

    def _check_leaves(self, ref: TrajectoryRef) -> None:
        for held in self.trajectories.values():
            if held.sample_index == ref.sample_index and held.leaves != ref.leaves:
                raise MismatchError("leaves", f"group {ref.group_id} sample {ref.sample_index}: {ref.leaves} "
                                    f"leaves, {held.leaves} by {held.trajectory_id}")

    def _check_lengths(self, ref: SourceRef) -> None:
        """A trajectory, its log-probs and its teacher's cover the same response tokens."""
        tid = ref.trajectory_id
        if isinstance(ref, TrajectoryRef):
            pairs = [(ref.response_tokens, held[tid].tokens) for held in (self.logprobs, self.teacher) if tid in held]
        elif isinstance(ref, LogProbsRef) and tid in self.trajectories:
            pairs = [(self.trajectories[tid].response_tokens, ref.tokens)]
        else:
            return
        for tokens, logprobs in pairs:
            if tokens != logprobs:
                raise MismatchError("logprobs" if isinstance(ref, LogProbsRef) else "response_ids",
                                    f"group {ref.group_id} trajectory {tid}: {logprobs} log-probs for {tokens} "
                                    "response tokens")

    def put(self, ref: SourceRef) -> None:
        if isinstance(ref, RoutingRef):
            self.routing.setdefault(ref.trajectory_id, {})[ref.chunk_index] = ref
        else:
            self._held(ref)[ref.trajectory_id] = ref

    def _routing_chunks(self, trajectory_id: str) -> int | None:
        if trajectory_id in self.trajectories:
            return self.trajectories[trajectory_id].routing_chunks
        chunks = self.routing.get(trajectory_id)
        return next(iter(chunks.values())).num_chunks if chunks else None

    def samples(self) -> list[TrajectoryRef]:
        """Its trajectories in order: by sample, then leaf."""
        return sorted(self.trajectories.values(), key=lambda t: (t.sample_index, t.leaf))

    def manifest(self) -> list[GroupManifest]:
        out = []
        for t in self.samples():
            tid, lp = t.trajectory_id, self.logprobs[t.trajectory_id]
            chunks = [self.routing[tid][c] for c in sorted(self.routing.get(tid, {}))]
            teacher = self.teacher[tid].at if tid in self.teacher else (-1, -1, -1)
            out.append(GroupManifest(
                tid, t.group_id, t.prompt_id, t.sample_index, t.group_size, t.reward, t.status, t.engine_id,
                t.worker_id, t.submitted_at, t.finished_at, t.prompt_tokens, t.response_tokens, t.min_version,
                t.max_version, self.partition, t.at[1], t.at[2], lp.at[1], lp.at[2], [c.at[1] for c in chunks],
                [c.at[2] for c in chunks], teacher[1], teacher[2], t.leaf, t.leaves))
        return out


@dataclass(frozen=True)
class Outcome:
    """A group that left the assembler: emitted (``dropped`` is None) or dropped with its record. ``manifest`` is
    there whenever the group was complete, dropped or not."""

    group_id: str
    manifest: list[GroupManifest]
    handles: list[Any]
    dropped: Dropped | None = None
    partition: int = -1  # of its source records

    @property
    def drop_reason(self) -> str | None:
        return None if self.dropped is None else self.dropped.reason

    def as_decided(self, drop_reason: str | None, trainer_version: int) -> "Outcome":
        """The group as an earlier processor life decided it (``drop_reason`` None: emitted), whatever this life's
        verdict: that life's manifest or drop may be on the log already, and a group's fate is decided once."""
        if drop_reason == self.drop_reason:
            return self
        if drop_reason is None:
            if not self.manifest:
                raise ValueError(f"group {self.group_id}: emitted by an earlier life, incomplete here")
            return replace(self, dropped=None)
        detail = f"{drop_reason}, as an earlier life of the processor decided"
        if self.dropped is not None:
            return replace(self, dropped=replace(self.dropped, reason=drop_reason, detail=detail))
        return replace(self, dropped=drop_record(self.group_id, self.manifest, drop_reason, detail, "processor",
                                                 trainer_version))


class GroupAssembler:
    def __init__(self, group_filter: GroupFilter | None = None, max_staleness: int | None = None,
                 needs_teacher: bool = False):
        self.group_filter = group_filter
        self.max_staleness = max_staleness
        self.needs_teacher = needs_teacher  # on-policy distillation: a sample waits for its teacher's log-probs
        self.latest_version = 0
        self.partial: dict[str, PartialGroup] = {}
        self.finished: set[str] = set()  # group ids already emitted or dropped

    def knows(self, group_id: str) -> bool:
        """Whether the group is partial here or has already left this assembler."""
        return group_id in self.partial or group_id in self.finished

    def mark_finished(self, group_id: str) -> None:
        """Record a group that left before (e.g. before a restart): its records are duplicates now."""
        if group_id in self.partial:
            raise ValueError(f"group {group_id} is partial here; it cannot have left")
        self.finished.add(group_id)

    def add(self, ref: SourceRef, handle: Any = None) -> tuple[Outcome | None, bool]:
        """Add one record; returns (the group's outcome if it just completed, whether the record was new).

        Raises MismatchError (and keeps nothing of the record) when it contradicts its group.
        """
        if ref.group_id in self.finished:
            return None, False
        group = self.partial.get(ref.group_id) or PartialGroup(ref.group_size, ref.at[0], self.needs_teacher)
        if group.has(ref):
            return None, False
        group.check(ref)
        self.partial[ref.group_id] = group
        group.put(ref)
        group.handles.append(handle)
        if not group.complete():
            return None, True
        return self._finish(ref.group_id, self._verdict(group)), True

    def forget(self, partitions: set[int]) -> list[PartialGroup]:
        """Let go of the partial groups of ``partitions`` (another processor took them: it re-reads their records)."""
        gone = [gid for gid, group in self.partial.items() if group.partition in partitions]
        return [self.partial.pop(gid) for gid in gone]

    def overdue(self, older_than_s: float) -> list[str]:
        """The groups still incomplete after ``older_than_s`` seconds."""
        now = time.monotonic()
        return [gid for gid, g in self.partial.items() if now - g.first_seen > older_than_s]

    def expire(self, group_ids: Iterable[str]) -> list[Outcome]:
        """Drop these incomplete groups (reason ``incomplete``)."""
        outcomes = []
        for gid in group_ids:
            group = self.partial[gid]
            chunks = sum(len(c) for c in group.routing.values())
            detail = (f"{len(group.trajectories)}/{group.group_size} trajectories, {len(group.logprobs)} log-probs, "
                      f"{chunks} routing chunks" + (f", {len(group.teacher)} teacher log-probs" if group.needs_teacher
                                                    else ""))
            outcomes.append(self._finish(gid, ("incomplete", detail)))
        return outcomes

    def _verdict(self, group: PartialGroup) -> tuple[str, str] | None:
        samples = group.samples()
        failed = [s for s in samples if s.status == "error"]
        if failed:
            return "error", f"samples {_indices(failed)}: {failed[0].error}"
        aborted = _indices([s for s in samples if s.status == "aborted"])
        if aborted:
            return "aborted", f"samples {aborted} aborted"
        failed = [s for s in samples if s.reward_error]
        if failed:  # never trained on a made-up reward
            return "reward_error", f"samples {_indices(failed)}: {failed[0].reward_error}"
        if self.group_filter is not None:
            keep, reason = self.group_filter(group.manifest())
            if not keep:
                return "filtered", reason
        if self.max_staleness is not None and staleness(samples, self.latest_version) > self.max_staleness:
            return "stale", f"oldest version {oldest_version(samples)}, latest {self.latest_version}"
        return None

    def _finish(self, group_id: str, verdict: tuple[str, str] | None) -> Outcome:
        group = self.partial.pop(group_id)
        self.finished.add(group_id)
        samples = group.samples()
        manifest = group.manifest() if group.complete() else []
        if verdict is None:
            return Outcome(group_id, manifest, group.handles, None, group.partition)
        dropped = drop_record(group_id, samples, verdict[0], verdict[1], "processor", self.latest_version)
        return Outcome(group_id, manifest, group.handles, dropped, group.partition)


def _indices(samples: Sequence[TrajectoryRef]) -> list[int]:
    return sorted({s.sample_index for s in samples})


def drop_record(group_id: str, samples: Sequence[Versioned], reason: str, detail: str,
                dropped_by: str, trainer_version: int) -> Dropped:
    oldest = oldest_version(samples)
    return Dropped(
        group_id=group_id, prompt_id=samples[0].prompt_id if samples else "", reason=reason, detail=detail,
        dropped_by=dropped_by, num_samples=len(samples), min_version=-1 if oldest is None else oldest,
        trainer_version=trainer_version, mean_reward=episode_mean(samples),
        ts=time.time(),
    )


def record_positions(row: GroupManifest) -> list[tuple[topics.TopicSpec, int, int, str]]:
    """Where a manifest row's records lie: (topic, offset, row in the value, the manifest field that says so) of
    its trajectory, its log-probs, its routing chunks in order and, under distillation, its teacher's log-probs."""
    return [(topics.TRAJECTORIES, row.trajectory_offset, row.trajectory_row, "trajectory_offset"),
            (topics.LOGPROBS, row.logprobs_offset, row.logprobs_row, "logprobs_offset"),
            *((topics.ROUTING, offset, index, "routing_offsets")
              for offset, index in zip(row.routing_offsets, row.routing_rows)),
            *([(topics.TEACHER_LOGPROBS, row.teacher_offset, row.teacher_row, "teacher_offset")]
              if row.teacher_offset >= 0 else [])]


def join_sample(row: GroupManifest, records: Sequence[Record]) -> GroupSample:
    """The sample a manifest row names, from the records at its ``record_positions`` (in that order); MismatchError
    (naming the field) when they are not the records it describes."""
    trajectory, logprobs, *rest = records
    chunks, teacher = (rest[:-1], rest[-1]) if row.teacher_offset >= 0 else (rest, None)
    sample_id = row.trajectory_id
    for record in records:
        if record.trajectory_id != sample_id or record.group_id != row.group_id:
            raise MismatchError("trajectory_id", f"{sample_id}: the record at its position is {record.trajectory_id}")
    expected = (Trajectory, LogProbs, *(Routing for _ in chunks), *((TeacherLogProbs,) if teacher else ()))
    if tuple(type(r) for r in records) != expected:
        raise MismatchError("trajectory_offset", f"{sample_id}: records {[type(r).__name__ for r in records]}")
    versions = trajectory.token_versions
    described = (row.prompt_tokens, row.response_tokens, row.status, row.reward, len(row.routing_offsets),
                 row.min_version, row.max_version, row.leaf, row.leaves)
    found = (len(trajectory.prompt_ids), len(trajectory.response_ids), trajectory.status, trajectory.reward,
             trajectory.routing_chunks, min(versions, default=-1), max(versions, default=-1), trajectory.leaf,
             trajectory.leaves)
    covered = [len(lp.logprobs) for lp in (logprobs, teacher) if lp is not None]
    if described != found or covered != [row.response_tokens] * len(covered):
        raise MismatchError("response_tokens", f"{sample_id}: the manifest says (prompt, response, status, reward, "
                            f"routing chunks, versions, leaf, leaves) {described}, its records {found}, "
                            f"log-probs {covered}")
    if [c.chunk_index for c in chunks] != list(range(len(chunks))):
        raise MismatchError("routing_offsets", f"{sample_id}: chunks {[c.chunk_index for c in chunks]} in its order")
    return GroupSample(**trajectory.to_row(), logprobs=logprobs.logprobs, **joined_fields(list(chunks)),
                       teacher_logprobs=teacher.logprobs if teacher is not None else [])
