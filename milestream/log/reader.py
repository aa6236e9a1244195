"""The one reader of a run's log, from the on-disk archive or from the topics of a live broker.

Both give the same thing, ``LoggedMessage``: a topic's messages in partition and offset order, each
with its key, broker timestamp and decoded records, so the audit, restore, selection, export, the
metrics feed and the offline re-drives never care which. A value that does not decode is handed to
the reader's ``OnBadRecord`` policy: ``raise_bad_record`` (the default) raises the ``RecordError``
naming topic, partition, offset and field; ``SkipBadRecords`` logs it, skips it and counts it.
A reader of big topics that needs a few fields only asks for them (``read_archive_fields``): the values
are checked against their schema as always, but only those columns become Python objects.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Iterator, Protocol, Sequence, TypeVar

from milestream.config import Config, UserError
from milestream.infra.kafka import Admin, RecordConsumer
from milestream.log.archive import load_manifest, read_topic
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, decode_table
from milestream.schemas.records import Record

log = logging.getLogger(__name__)
T = TypeVar("T")
Fields = dict[str, Any]  # some fields of one record, by name


@dataclass(frozen=True)
class LoggedMessage(Generic[T]):
    """One message of a topic: where it lies, when the broker stamped it, its key and its records."""

    topic: str  # catalogue name (no prefix)
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    records: list[T]

    @property
    def position(self) -> Position:
        return Position(self.topic, self.partition, self.offset)


class OnBadRecord(Protocol):
    def __call__(self, error: RecordError) -> None:
        """Raise ``error``, or return to have the reader skip the record."""


class DamagedLog(UserError, RecordError):
    """A record of a logged run that does not decode, met by a reader of the run: the log is damaged, not
    the program (the live stages dead-letter such records instead)."""


def raise_bad_record(error: RecordError) -> None:
    raise DamagedLog(error.position, error.field, error.reason) from None


@dataclass
class SkipBadRecords:
    """Skip a record that does not decode, after logging where it lies and why; ``skipped`` counts them.

    For observers of the loop: they must not stop on a record the processor has already dead-lettered.
    """

    skipped: int = 0

    def __call__(self, error: RecordError) -> None:
        log.error("skipping a record that does not decode: %s", error)
        self.skipped += 1


def _read_archive(run_dir: str | Path, spec: topics.TopicSpec, on_bad: OnBadRecord,
              convert: Callable[[bytes | None, Position], list[T]]) -> Iterator[LoggedMessage[T]]:
    load_manifest(run_dir)  # no run or no archive is an error, never an empty log
    table = read_topic(run_dir, spec.name, ("partition", "offset", "timestamp_ms", "key", "value"))
    for batch in table.to_batches(max_chunksize=1024):
        for row in batch.to_pylist():
            position = Position(spec.name, row["partition"], row["offset"])
            try:
                records = convert(row["value"], position)
            except RecordError as exc:
                on_bad(exc)
                continue
            yield LoggedMessage(spec.name, row["partition"], row["offset"], row["timestamp_ms"], row["key"], records)


def read_archive(run_dir: str | Path, spec: topics.TopicSpec,
             on_bad: OnBadRecord = raise_bad_record) -> Iterator[LoggedMessage[Record]]:
    """Every archived message of ``spec`` (RUN_DIR/archive, ``log/archive.py``), in partition and offset order."""
    return _read_archive(run_dir, spec, on_bad, lambda value, position: decode(value, spec.record, position))


def read_archive_fields(run_dir: str | Path, spec: topics.TopicSpec, fields: Sequence[str],
                    on_bad: OnBadRecord = raise_bad_record) -> Iterator[LoggedMessage[Fields]]:
    """As ``read_archive``, with only ``fields`` of each record: cheap on big topics (no token lists built)."""
    def convert(value: bytes | None, position: Position) -> list[Fields]:
        return decode_table(value, spec.record, position).select(list(fields)).to_pylist()

    return _read_archive(run_dir, spec, on_bad, convert)


class LogSource(Protocol):
    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage[Record]]:
        """Every message of ``spec``, in partition and offset order."""

    def fields(self, spec: topics.TopicSpec, names: Sequence[str]) -> list[LoggedMessage[Fields]]:
        """As ``messages``, with only the fields ``names`` of each record (cheap where the source can skip the rest)."""

    def prefetch(self, specs: Iterable[topics.TopicSpec]) -> None:
        """Start reading ``specs`` at once: a reader of several topics calls it first, so their waits overlap."""


class ArchiveSource:
    """The Parquet segments under RUN_DIR/archive, each topic read once."""

    def __init__(self, run_dir: str | Path, on_bad: OnBadRecord = raise_bad_record):
        self.run_dir, self.on_bad = Path(run_dir), on_bad

    @functools.cache
    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage[Record]]:
        return list(read_archive(self.run_dir, spec, self.on_bad))

    def fields(self, spec: topics.TopicSpec, names: Sequence[str]) -> list[LoggedMessage[Fields]]:
        return list(read_archive_fields(self.run_dir, spec, names, self.on_bad))

    def prefetch(self, specs: Iterable[topics.TopicSpec]) -> None:
        """Nothing to overlap: a topic is read from disk without waiting."""


class BrokerSource:
    """A run's topics on a live broker, read from the beginning without joining a consumer group.

    Each partition is read at least up to the end offset the broker reports when reading starts (on
    tansu that is the last batch's start + 1, a lower bound; NOTES.md), then until the topic stays
    quiet for ``idle_s``: a run still writing may have more by the time the reader stops. Each topic is read
    once, by its own consumer in a thread of its own: the topics given to ``prefetch`` are read at the same
    time, so a reader of every topic waits ``idle_s`` once, not once per topic.
    """

    def __init__(self, cfg: Config, idle_s: float = 1.0, max_wait_s: float = 120.0,
                 on_bad: OnBadRecord = raise_bad_record):
        self.cfg, self.idle_s, self.max_wait_s, self.on_bad = cfg, idle_s, max_wait_s, on_bad
        self._reads: dict[str, Future[list[LoggedMessage[Record]]]] = {}
        self._pool = ThreadPoolExecutor(len(topics.CATALOGUE), thread_name_prefix="read")

    def prefetch(self, specs: Iterable[topics.TopicSpec]) -> None:
        for spec in specs:
            if spec.name not in self._reads:
                self._reads[spec.name] = self._pool.submit(self._read_topic, spec)

    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage[Record]]:
        """A read's error is raised here, in the caller's thread."""
        self.prefetch([spec])
        return self._reads[spec.name].result()

    def _read_topic(self, spec: topics.TopicSpec) -> list[LoggedMessage[Record]]:
        partitions = Admin(self.cfg.broker).partitions(spec)
        reader: RecordConsumer = RecordConsumer(self.cfg.broker, spec, f"{self.cfg.broker.topic_prefix}replay-{time.time()}")
        try:
            reader.assign(partitions=partitions)
            return self._read(reader, spec, reader.ends())
        finally:
            reader.close()

    def fields(self, spec: topics.TopicSpec, names: Sequence[str]) -> list[LoggedMessage[Fields]]:
        """Decoded whole on the way in (a consumer hands records, not columns), then cut to ``names``."""
        return [dataclasses.replace(m, records=[{name: getattr(r, name) for name in names} for r in m.records])
                for m in self.messages(spec)]

    def _read(self, reader: RecordConsumer, spec: topics.TopicSpec,
              ends: dict[int, int]) -> list[LoggedMessage[Record]]:
        out: list[LoggedMessage[Record]] = []
        deadline = time.monotonic() + self.max_wait_s
        while True:
            behind = not reader.reached(ends)
            try:
                delivery = reader.poll(0.5 if behind else self.idle_s)
            except RecordError as exc:  # read all the same: it counts towards its partition's end
                self.on_bad(exc)
                continue
            if delivery is not None:
                position = delivery.position
                out.append(LoggedMessage(spec.name, position.partition, position.offset, round(delivery.ts * 1000),
                                         delivery.key, delivery.records))
            elif not behind:
                return sorted(out, key=lambda m: (m.partition, m.offset))
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{spec.name}: partitions not read to their end offsets {ends} within "
                                   f"{self.max_wait_s:.0f} s")
