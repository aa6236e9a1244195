"""Where an offline reader gets a run's log: the on-disk archive, or the topics of a live broker.

Both give the same thing, a topic's messages in partition and offset order with their decoded
records and the broker timestamp, so selection, export and the offline re-drives never care which.
A value that does not decode raises ``RecordError`` naming topic, partition, offset and field.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from confluent_kafka import TopicPartition

from milestream.config import Config
from milestream.log.archive import iter_rows
from milestream.infra.kafka import Admin, RecordConsumer
from milestream.schemas import topics
from milestream.schemas.codec import Position, decode
from milestream.schemas.records import Record


@dataclass(frozen=True)
class LoggedMessage:
    """One message of a topic: where it lies, when the broker stamped it, and its records."""

    topic: str  # catalogue name (no prefix)
    partition: int
    offset: int
    timestamp_ms: int
    records: list[Record]


class LogSource(Protocol):
    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage]:
        """Every message of ``spec``, in partition and offset order."""


class ArchiveSource:
    """The Parquet segments under RUN_DIR/archive (``log/archive.py``)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)

    @functools.cache
    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage]:
        return [LoggedMessage(spec.name, row["partition"], row["offset"], row["timestamp_ms"],
                              decode(row["value"], spec.record, Position(spec.name, row["partition"], row["offset"])))
                for row in iter_rows(self.run_dir, spec.name)]


class BrokerSource:
    """A run's topics on a live broker, read from the beginning without joining a consumer group.

    Each partition is read at least up to the end offset the broker reports when reading starts (on
    tansu that is the last batch's start + 1, a lower bound; NOTES.md), then until the topic stays
    quiet for ``idle_s``: a run still writing may have more by the time the reader stops.
    """

    def __init__(self, cfg: Config, idle_s: float = 1.0, max_wait_s: float = 120.0):
        self.cfg, self.idle_s, self.max_wait_s = cfg, idle_s, max_wait_s

    @functools.cache
    def messages(self, spec: topics.TopicSpec) -> list[LoggedMessage]:
        partitions = Admin(self.cfg.broker).partitions(spec)
        reader: RecordConsumer = RecordConsumer(self.cfg.broker, spec, f"{self.cfg.broker.topic_prefix}replay-{time.time()}")
        try:
            reader.assign(partitions=partitions)
            return self._read(reader, spec, {p: _end_offset(reader, p) for p in partitions})
        finally:
            reader.close()

    def _read(self, reader: RecordConsumer, spec: topics.TopicSpec, ends: dict[int, int]) -> list[LoggedMessage]:
        out: list[LoggedMessage] = []
        reached = dict.fromkeys(ends, 0)
        deadline = time.monotonic() + self.max_wait_s
        while True:
            behind = {p: (reached[p], end) for p, end in ends.items() if reached[p] < end}
            delivery = reader.poll(0.5 if behind else self.idle_s)
            if delivery is not None:
                position = delivery.position
                out.append(LoggedMessage(spec.name, position.partition, position.offset, round(delivery.ts * 1000),
                                         delivery.records))
                reached[position.partition] = max(reached[position.partition], position.offset + 1)
            elif not behind:
                return sorted(out, key=lambda m: (m.partition, m.offset))
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{spec.name}: partitions (read up to, end offset) {behind} not read to their "
                                   f"end offsets within {self.max_wait_s:.0f} s")


def _end_offset(reader: RecordConsumer, partition: int) -> int:
    _, high = reader.consumer.get_watermark_offsets(TopicPartition(reader.topic, partition), timeout=10)
    return max(high, 0)
