"""Group assembly and the arrival drop rules, free of any broker so they can be tested alone.

A group is complete when every sample has its trajectory, its log-probs, when its engine recorded
MoE routing (``Trajectory.routing_chunks`` > 0) every routing chunk, and under on-policy distillation
(``distill``) its teacher's log-probs. Records may arrive in any order
and are de-duplicated by (sample, chunk), so a re-read (after a restart) or a duplicate publish is
harmless.
On completion a group is dropped when a sample failed (status ``error``: the engine or a rollout layer
raised), then, in Miles' order, when a sample was aborted, when a sample's reward
failed (``reward_error``), when the user filter rejects it, or (a pre-drop) when it is already past the
staleness window of the latest version seen.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import zstandard

from milestream.config import import_path
from milestream.schemas import topics
from milestream.schemas.records import Dropped, GroupSample, LogProbs, Routing, TeacherLogProbs, Trajectory
from milestream.schemas.routing import COMPRESSION, PLAIN_COMPRESSION, joined_fields

SourceRecord = Trajectory | LogProbs | Routing | TeacherLogProbs


def source_topics(teacher: bool) -> tuple[topics.TopicSpec, ...]:
    """The topics a group is joined from; ``teacher``: on-policy distillation is on."""
    return (topics.TRAJECTORIES, topics.LOGPROBS, topics.ROUTING) + ((topics.TEACHER_LOGPROBS,) if teacher else ())
GroupFilter = Callable[[Sequence[GroupSample]], tuple[bool, str]]


def load_filter(path: str | None) -> GroupFilter | None:
    """``package.module:function`` (or ``package.module.function``) -> the function."""
    return import_path(path, "buffer.filter") if path else None


def oldest_version(samples: Sequence[Trajectory]) -> int | None:
    """The oldest weight version of any token in the group; a group is never fresher than it."""
    versions = [v for s in samples for v in s.token_versions]
    return min(versions) if versions else None


def staleness(samples: Sequence[Trajectory], current_version: int) -> int:
    oldest = oldest_version(samples)
    return 0 if oldest is None else current_version - oldest


class MismatchError(ValueError):
    """A record that does not fit its group; ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


def check_record(record: SourceRecord | GroupSample, group_size: int) -> None:
    """Raise MismatchError naming the field of a record that no rollout worker of this run writes: the
    rules that hold for each record alone, whatever its group holds (a value that decodes can be hostile)."""
    if record.group_size != group_size:
        raise MismatchError("group_size", f"group size {record.group_size}, the run's is {group_size}")
    if not 0 <= record.sample_index < group_size:
        raise MismatchError("sample_index", f"sample {record.sample_index} of a group of {group_size}")
    if record.trajectory_id != f"{record.group_id}/{record.sample_index}":
        raise MismatchError("trajectory_id", f"{record.trajectory_id!r} is not sample {record.sample_index} "
                            f"of group {record.group_id!r}")
    if isinstance(record, Trajectory):
        _check_trajectory(record)
    if isinstance(record, TeacherLogProbs) and any(not lp <= 0.0 for lp in record.logprobs):
        raise MismatchError("logprobs", "a NaN or positive teacher log-prob")
    if isinstance(record, (LogProbs, GroupSample)):
        _check_logprobs(record)
    elif isinstance(record, Routing):
        _check_routing(record)


def _check_trajectory(t: Trajectory) -> None:
    if t.status not in Trajectory.STATUSES:
        raise MismatchError("status", f"status {t.status!r} is not one of {Trajectory.STATUSES}")
    for name in ("loss_mask", "token_versions"):
        if len(getattr(t, name)) != len(t.response_ids):
            raise MismatchError(name, f"{len(getattr(t, name))} values for {len(t.response_ids)} response tokens")
    if any(m not in (0, 1) for m in t.loss_mask):
        raise MismatchError("loss_mask", "values other than 0 and 1")
    for name in ("prompt_ids", "response_ids", "token_versions"):
        if min(getattr(t, name), default=0) < 0:
            raise MismatchError(name, "a negative value")
    for name in ("reward", "submitted_at", "finished_at"):
        if not math.isfinite(getattr(t, name)):
            raise MismatchError(name, f"{getattr(t, name)} is not finite")
    if not 0 <= t.routing_chunks <= max(1, len(t.prompt_ids) + len(t.response_ids)):
        raise MismatchError("routing_chunks", f"{t.routing_chunks} routing chunks for "
                            f"{len(t.prompt_ids) + len(t.response_ids)} tokens")


def _check_logprobs(record: LogProbs | GroupSample) -> None:
    """Log-probs are never NaN nor above 0 (-inf is a token the engine found impossible: the loss guards it)."""
    if any(not lp <= 0.0 for lp in record.logprobs):
        raise MismatchError("logprobs", "a NaN or positive log-prob")
    if isinstance(record, GroupSample):
        for name in ("logprobs", "teacher_logprobs"):
            values = getattr(record, name)
            if (values or name == "logprobs") and len(values) != len(record.response_ids):
                raise MismatchError(name, f"{len(values)} log-probs for {len(record.response_ids)} response tokens")
        if any(not lp <= 0.0 for lp in record.teacher_logprobs):
            raise MismatchError("teacher_logprobs", "a NaN or positive log-prob")
        return
    if (record.topk_ids is None) != (record.topk_logprobs is None):
        raise MismatchError("topk_ids", "top-k ids and log-probs come together")
    if record.topk_ids is not None:
        shapes = [len(row) for row in record.topk_ids], [len(row) for row in record.topk_logprobs]
        if len(record.topk_ids) != len(record.logprobs) or shapes[0] != shapes[1]:
            raise MismatchError("topk_ids", "top-k ids and log-probs differ in shape from each other or the tokens")


def _check_routing(r: Routing) -> None:
    if not 0 <= r.chunk_index < r.num_chunks:
        raise MismatchError("chunk_index", f"chunk {r.chunk_index} of {r.num_chunks}")
    if r.id_bytes not in (1, 2) or min(r.num_tokens, r.num_layers, r.top_k) < 0:
        raise MismatchError("id_bytes", f"layout {[r.num_tokens, r.num_layers, r.top_k, r.id_bytes]}")
    if r.compression not in (COMPRESSION, PLAIN_COMPRESSION):
        raise MismatchError("compression", f"unknown routing compression {r.compression!r}")
    ids_bytes = r.num_layers * r.top_k * r.id_bytes
    whole = r.num_tokens * ids_bytes
    try:  # a frame that claims more than the layout holds is refused before it is inflated (the size a frame
        # declares wins over max_output_size, which bounds only a frame that declares none)
        if zstandard.frame_content_size(r.data) > whole:
            raise zstandard.ZstdError(f"the frame holds {zstandard.frame_content_size(r.data)} bytes")
        raw = zstandard.ZstdDecompressor().decompress(r.data, max_output_size=whole + 1)
    except zstandard.ZstdError as exc:
        raise MismatchError("data", f"routing data does not decompress within its layout: {exc}") from None
    if len(raw) > whole or (ids_bytes and len(raw) % ids_bytes):
        raise MismatchError("data", f"{len(raw)} bytes of routing for layout "
                            f"{[r.num_tokens, r.num_layers, r.top_k, r.id_bytes]}")


@dataclass
class PartialGroup:
    group_size: int
    needs_teacher: bool = False
    trajectories: dict[int, Trajectory] = field(default_factory=dict)
    logprobs: dict[int, LogProbs] = field(default_factory=dict)
    teacher: dict[int, TeacherLogProbs] = field(default_factory=dict)
    routing: dict[int, dict[int, Routing]] = field(default_factory=dict)  # sample -> chunk -> record
    handles: list[Any] = field(default_factory=list)  # source events, acknowledged when the group leaves
    first_seen: float = field(default_factory=time.monotonic)

    def complete(self) -> bool:
        return (len(self.trajectories) == self.group_size and len(self.logprobs) == self.group_size
                and (not self.needs_teacher or len(self.teacher) == self.group_size)
                and all(len(self.routing.get(i, {})) == t.routing_chunks for i, t in self.trajectories.items()))

    def has(self, record: SourceRecord) -> bool:
        if isinstance(record, Routing):
            return record.chunk_index in self.routing.get(record.sample_index, {})
        return record.sample_index in self._held(record)

    def _held(self, record: Trajectory | LogProbs | TeacherLogProbs) -> dict:
        if isinstance(record, Trajectory):
            return self.trajectories
        return self.teacher if isinstance(record, TeacherLogProbs) else self.logprobs

    def check(self, record: SourceRecord) -> None:
        """Raise MismatchError when the record contradicts what the group already holds."""
        if record.group_size != self.group_size or not 0 <= record.sample_index < self.group_size:
            raise MismatchError("group_size", f"group {record.group_id}: sample {record.sample_index} of "
                                f"{record.group_size} does not fit a group of {self.group_size}")
        self._check_lengths(record)
        expected = self._routing_chunks(record.sample_index)
        if isinstance(record, Trajectory):
            declared = record.routing_chunks
        elif isinstance(record, Routing):
            declared = record.num_chunks
            if not 0 <= record.chunk_index < record.num_chunks:
                raise MismatchError("chunk_index", f"group {record.group_id} sample {record.sample_index}: "
                                    f"chunk {record.chunk_index} of {record.num_chunks}")
        else:
            return
        if expected is not None and declared != expected:
            raise MismatchError("num_chunks" if isinstance(record, Routing) else "routing_chunks",
                                f"group {record.group_id} sample {record.sample_index}: {declared} routing chunks "
                                f"declared, {expected} by the records before")

    def _check_lengths(self, record: SourceRecord) -> None:
        """A trajectory, its log-probs and its teacher's cover the same response tokens."""
        i = record.sample_index
        if isinstance(record, Trajectory):
            pairs = [(len(record.response_ids), len(held[i].logprobs)) for held in (self.logprobs, self.teacher)
                     if i in held]
        elif isinstance(record, (LogProbs, TeacherLogProbs)) and i in self.trajectories:
            pairs = [(len(self.trajectories[i].response_ids), len(record.logprobs))]
        else:
            return
        for tokens, logprobs in pairs:
            if tokens != logprobs:
                raise MismatchError("response_ids" if isinstance(record, Trajectory) else "logprobs",
                                    f"group {record.group_id} sample {i}: {logprobs} log-probs for "
                                    f"{tokens} response tokens")

    def put(self, record: SourceRecord) -> None:
        if isinstance(record, Routing):
            self.routing.setdefault(record.sample_index, {})[record.chunk_index] = record
        else:
            self._held(record)[record.sample_index] = record

    def _routing_chunks(self, sample_index: int) -> int | None:
        if sample_index in self.trajectories:
            return self.trajectories[sample_index].routing_chunks
        chunks = self.routing.get(sample_index)
        return next(iter(chunks.values())).num_chunks if chunks else None

    def joined(self) -> list[GroupSample]:
        return [
            GroupSample(**self.trajectories[i].to_row(), logprobs=self.logprobs[i].logprobs,
                        **joined_fields(list(self.routing.get(i, {}).values())),
                        teacher_logprobs=self.teacher[i].logprobs if i in self.teacher else [])
            for i in sorted(self.trajectories)
        ]


@dataclass(frozen=True)
class Outcome:
    """A group that left the assembler: emitted (``dropped`` is None) or dropped with its record."""

    group_id: str
    samples: list[GroupSample]
    handles: list[Any]
    dropped: Dropped | None = None


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

    def add(self, record: SourceRecord, handle: Any = None) -> tuple[Outcome | None, bool]:
        """Add one record; returns (the group's outcome if it just completed, whether the record was new).

        Raises MismatchError (and keeps nothing of the record) when it contradicts its group.
        """
        if record.group_id in self.finished:
            return None, False
        group = self.partial.get(record.group_id) or PartialGroup(record.group_size, self.needs_teacher)
        if group.has(record):
            return None, False
        group.check(record)
        self.partial[record.group_id] = group
        group.put(record)
        group.handles.append(handle)
        if not group.complete():
            return None, True
        return self._finish(record.group_id, self._verdict(group.joined())), True

    def expire(self, older_than_s: float) -> list[Outcome]:
        """Drop the groups still incomplete after ``older_than_s`` seconds."""
        now = time.monotonic()
        expired = [gid for gid, g in self.partial.items() if now - g.first_seen > older_than_s]
        outcomes = []
        for gid in expired:
            group = self.partial[gid]
            samples = [GroupSample(**t.to_row()) for t in group.trajectories.values()]
            chunks = sum(len(c) for c in group.routing.values())
            detail = (f"{len(group.trajectories)}/{group.group_size} trajectories, {len(group.logprobs)} log-probs, "
                      f"{chunks} routing chunks" + (f", {len(group.teacher)} teacher log-probs" if group.needs_teacher
                                                    else ""))
            outcomes.append(self._finish(gid, ("incomplete", detail), samples))
        return outcomes

    def _verdict(self, samples: list[GroupSample]) -> tuple[str, str] | None:
        failed = [s for s in samples if s.status == "error"]
        if failed:
            return "error", f"samples {[s.sample_index for s in failed]}: {failed[0].error}"
        aborted = [s.sample_index for s in samples if s.status == "aborted"]
        if aborted:
            return "aborted", f"samples {aborted} aborted"
        failed = [s for s in samples if s.reward_error]
        if failed:  # never trained on a made-up reward
            return "reward_error", f"samples {[s.sample_index for s in failed]}: {failed[0].reward_error}"
        if self.group_filter is not None:
            keep, reason = self.group_filter(samples)
            if not keep:
                return "filtered", reason
        if self.max_staleness is not None and staleness(samples, self.latest_version) > self.max_staleness:
            return "stale", f"oldest version {oldest_version(samples)}, latest {self.latest_version}"
        return None

    def _finish(self, group_id: str, verdict: tuple[str, str] | None,
                samples: list[GroupSample] | None = None) -> Outcome:
        group = self.partial.pop(group_id)
        self.finished.add(group_id)
        samples = samples if samples is not None else group.joined()
        dropped = None
        if verdict is not None:
            dropped = drop_record(group_id, samples, verdict[0], verdict[1], "processor", self.latest_version)
        return Outcome(group_id, samples, group.handles, dropped)


def drop_record(group_id: str, samples: Sequence[Trajectory], reason: str, detail: str,
                dropped_by: str, trainer_version: int) -> Dropped:
    oldest = oldest_version(samples)
    rewards = [s.reward for s in samples]
    return Dropped(
        group_id=group_id, prompt_id=samples[0].prompt_id if samples else "", reason=reason, detail=detail,
        dropped_by=dropped_by, num_samples=len(samples), min_version=-1 if oldest is None else oldest,
        trainer_version=trainer_version, mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        ts=time.time(),
    )
