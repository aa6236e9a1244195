"""Offsets committed with state: where a consumer may resume without losing or repeating work.

The rule, for every reader whose work outlives the read (a record becomes a group, a sample, a
trained step, an evaluation result): commit a source offset only below the oldest record whose
outcome is not yet durable, and on a re-read recognise what was done by its deterministic id.
Records finish out of order, so the commit point of a partition is its oldest offset still held
(one past the newest read when none is); a restart re-reads, never skips, what was in progress.

Its users:
  the rollout worker       prompts: held from admission until the group's samples are flushed;
                           the processor drops re-generated samples by (sample, chunk)
  the stream processor     rollout sources: held until every group holding one of its records has
                           settled (streams/processor.py); a re-read record of a settled group is a
                           duplicate (streams/ledger.py)
  the trainer's collector  buffer.groups: held until the group is taken or dropped; the commit points
                           go into the trainer's checkpoint with the seen group ids, which skip the
                           groups it re-reads
  the evaluator            weights.versions: held until the version's result is published

Where a reader writes what it made of its records and commits its read offsets, it does so in one order,
``Checkpoint.commit`` (as Quix Streams' checkpoint does): what it wrote reaches the log (the producer
flushed), then the state it keeps is saved, then the offsets are committed. A crash between two steps
redoes work, which the re-read recognises by id; any other order could commit past work that never
reached the log. The trainer and the trackers keep their offsets in their own saved state (a checkpoint,
a position file) and commit none to the broker: their save is that last step.
"""
from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Generic, Hashable, Mapping, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)  # a partition: its number, or a (topic, partition)


class HeldOffsets(Generic[K]):
    """Per partition, the offsets read and not yet done; their commit points.

    Offsets are reference-counted, because a rebalance can deliver the same offset twice. ``resumed``:
    the commit points a restarted reader started from, kept for the partitions it has not read since.
    """

    def __init__(self, resumed: Mapping[K, int] | None = None):
        self._resumed = dict(resumed or {})
        self._held: dict[K, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        self._next: dict[K, int] = {}  # one past the newest offset read

    def started(self, partition: K, offset: int) -> None:
        self._held[partition][offset] += 1
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition: K, offset: int) -> None:
        held = self._held[partition]
        held[offset] -= 1
        if held[offset] <= 0:
            del held[offset]

    def commit_point(self, partition: K) -> int | None:
        """The next offset to read on resume; None when nothing was read (nothing to commit)."""
        if partition not in self._next:
            return self._resumed.get(partition)
        held = self._held[partition]
        return min(held) if held else self._next[partition]

    def committable(self) -> dict[K, int]:
        return {p: point for p in {*self._resumed, *self._next} if (point := self.commit_point(p)) is not None}

    def held(self) -> int:
        return sum(sum(counts.values()) for counts in self._held.values())


class Flushes(Protocol):
    def flush(self, timeout: float = ...) -> None: ...


class Commits(Protocol):
    def commit(self, offsets: dict, wait: bool = ...) -> bool: ...


class Checkpoint(Generic[K]):
    """A reader's one ordered commit (see the module's docstring): ``offsets`` gives the offsets to commit
    once the producer is flushed and ``save`` (when given) has saved the state they go with."""

    def __init__(self, producer: Flushes, consumer: Commits, offsets: Callable[[], Mapping[K, int]]):
        self.producer, self.consumer, self.offsets = producer, consumer, offsets

    def commit(self, save: Callable[[], None] | None = None, wait: bool = True) -> bool:
        """False when the broker refused the offsets (a rebalance under way): the next commit carries them."""
        self.producer.flush()
        if save is not None:
            save()
        return self.consumer.commit(dict(self.offsets()), wait=wait)
