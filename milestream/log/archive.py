"""The archive consumer: every topic of the catalogue, byte for byte, in Parquet segments on disk.

The embedded broker keeps its data in memory only; the archive is what makes the log durable on one
machine and what ``milestream replay --republish`` puts back into a fresh broker.

Layout under ``RUN_DIR/archive/``::

    manifest.json          topic prefix, and per topic its partitions and max.message.bytes
    state.json             next offset per topic-partition, next segment number per topic, and the
                           consumer groups' committed offsets (snapshotted with every flush)
    <topic>/000000000007.parquet   one segment; <topic> is the catalogue name (no prefix)

A row keeps everything replay needs to be byte-exact: topic, partition, offset, timestamp (and its
type), key, every header (and the ``ms-schema`` header's schema id in its own column, for queries)
and the raw value bytes.

Durability:

- A segment is written to a temporary file, fsynced and renamed; only then is ``state.json``
  rewritten (again temp + fsync + rename). A crash between the two leaves a segment the state does
  not mention: on start the archiver reads the offsets of such segments and moves past them, so a
  restarted archiver neither duplicates nor skips a record.
- A row is on disk at most ``flush_s`` (default 1 s) + one poll (0.2 s) after the archiver read it;
  a segment also closes at ``segment_records`` rows or ``segment_bytes`` bytes.
- **Loss bound.** The archiver's own crash loses nothing while the broker lives (it re-reads from
  its state). Losing the in-memory broker loses what the archiver had not yet flushed: the records
  appended in about the last ``flush_s`` + 0.25 s (~1.25 s with the defaults), plus any backlog the
  archiver had not yet fetched. A planned restart loses nothing: stop the stages, let the archiver
  drain (``Archiver.run`` returns only after ``idle_s`` of quiet and a final flush), then stop the
  broker.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from milestream.config import Config, RunFolderError, run_folder
from milestream.infra import faults
from milestream.infra.kafka import LogAdmin, RawConsumer, RawMessage, topic_name
from milestream.schemas import topics
from milestream.schemas.codec import SCHEMA_HEADER

log = logging.getLogger(__name__)

HEADER = pa.struct([("key", pa.string()), ("value", pa.large_binary())])
ROW_SCHEMA = pa.schema([
    ("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
    ("timestamp_ms", pa.int64()), ("timestamp_type", pa.int8()),
    ("key", pa.large_binary()), ("schema_id", pa.string()),
    ("headers", pa.list_(HEADER)), ("value", pa.large_binary()),
])
SEGMENT_SUFFIX = ".parquet"


def archive_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "archive"


def write_atomically(path: Path, data: bytes) -> None:
    """temp + fsync + rename + fsync of the folder: after a crash the file is the old or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class ArchiveState:
    """Where the archive stands; offsets and segment numbers are keyed by catalogue topic name."""

    offsets: dict[str, dict[int, int]] = field(default_factory=dict)  # next offset to archive
    segments: dict[str, int] = field(default_factory=dict)  # next segment number
    groups: dict[str, dict[str, dict[int, int]]] = field(default_factory=dict)  # group -> topic -> p -> offset
    groups_at: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps({"offsets": self.offsets, "segments": self.segments, "groups": self.groups,
                           "groups_at": self.groups_at, "updated_at": time.time()}, indent=1).encode()

    @classmethod
    def load(cls, run_dir: str | Path) -> "ArchiveState":
        path = archive_dir(run_dir) / "state.json"
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        return cls({t: {int(p): o for p, o in parts.items()} for t, parts in raw["offsets"].items()},
                   dict(raw["segments"]),
                   {g: {t: {int(p): o for p, o in parts.items()} for t, parts in tps.items()}
                    for g, tps in raw.get("groups", {}).items()},
                   raw.get("groups_at", 0.0))


def load_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The archive's manifest; every reader of an archive starts here (RunFolderError: no run, or no archive)."""
    path = archive_dir(run_folder(run_dir)) / "manifest.json"
    if not path.exists():
        raise RunFolderError(f"{run_dir}: no archive in this run folder ({path} is missing): the run had "
                             "run.archive off or was on a Kafka cluster, whose log is on the brokers (replay and "
                             "mismatch read it with --from-broker)")
    return json.loads(path.read_text())


def segment_paths(run_dir: str | Path, topic: str) -> list[Path]:
    folder = archive_dir(run_dir) / topic
    return sorted(folder.glob(f"*{SEGMENT_SUFFIX}")) if folder.exists() else []


def read_topic(run_dir: str | Path, topic: str, columns: Sequence[str]) -> pa.Table:
    """``columns`` of every archived row of one topic (catalogue name), in partition and offset order."""
    schema = pa.schema([ROW_SCHEMA.field(name) for name in columns])
    tables = [pq.read_table(path, columns=list(columns), schema=ROW_SCHEMA).select(list(columns))
              for path in segment_paths(run_dir, topic)]
    if not tables:
        return schema.empty_table()
    return pa.concat_tables(tables).sort_by([("partition", "ascending"), ("offset", "ascending")])


def archived_raw(run_dir: str | Path, topic: str) -> Iterator[RawMessage]:
    """Every archived message of one topic as it was on the broker, segment by segment (in time order;
    each segment's rows in partition and offset order)."""
    for path in segment_paths(run_dir, topic):
        for row in pq.read_table(path, schema=ROW_SCHEMA).to_pylist():
            headers = None if row["headers"] is None else [(h["key"], h["value"]) for h in row["headers"]]
            yield RawMessage(row["topic"], row["partition"], row["offset"], row["timestamp_ms"],
                             row["timestamp_type"], row["key"], headers, row["value"])


def recover(run_dir: str | Path, state: ArchiveState) -> ArchiveState:
    """Move past segments written after the last state (a crash between segment and state)."""
    for path in archive_dir(run_dir).glob(f"*/.*{SEGMENT_SUFFIX}.tmp"):
        path.unlink()  # a segment that never got renamed: its rows were never recorded as archived
    for topic_dir in (p for p in archive_dir(run_dir).iterdir() if p.is_dir()):
        topic = topic_dir.name
        for path in segment_paths(run_dir, topic):
            number = int(path.stem)
            if number < state.segments.get(topic, 0):
                continue
            table = pq.read_table(path, columns=["partition", "offset"])
            offsets = state.offsets.setdefault(topic, {})
            for partition, offset in zip(table["partition"].to_pylist(), table["offset"].to_pylist()):
                offsets[partition] = max(offsets.get(partition, 0), offset + 1)
            state.segments[topic] = number + 1
            log.warning("archive: segment %s was not in the state; resuming after it", path)
    return state


def archive_row(msg: RawMessage) -> dict[str, Any]:
    schema_id = next((v.decode(errors="replace") for k, v in msg.headers or () if k == SCHEMA_HEADER and v), None)
    return {"topic": msg.topic, "partition": msg.partition, "offset": msg.offset, "timestamp_ms": msg.timestamp_ms,
            "timestamp_type": msg.timestamp_type, "key": msg.key, "schema_id": schema_id,
            "headers": None if msg.headers is None else [{"key": k, "value": v} for k, v in msg.headers],
            "value": msg.value}


def write_segment(root: Path, topic: str, number: int, rows: list[dict[str, Any]]) -> None:
    """One segment of ``archive_row`` rows under ``root`` (an archive folder), written atomically; the caller
    records it in the state after."""
    folder = root / topic
    folder.mkdir(exist_ok=True)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), sink, compression="zstd")
    write_atomically(folder / f"{number:012d}{SEGMENT_SUFFIX}", sink.getvalue().to_pybytes())


class Archiver:
    """Reads every catalogue topic from its own recorded position and writes Parquet segments."""

    def __init__(self, cfg: Config, run_dir: str | Path | None = None, flush_s: float = 1.0,
                 segment_records: int = 10_000, segment_bytes: int = 64 * 1024 * 1024, idle_s: float = 1.0):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run.run_dir)
        self.root = archive_dir(self.run_dir)
        self.flush_s, self.segment_records, self.segment_bytes, self.idle_s = flush_s, segment_records, segment_bytes, idle_s
        self.names = {topic_name(cfg.broker, spec): spec.name for spec in topics.CATALOGUE}
        self.state = ArchiveState()
        self.buffers: dict[str, list[dict[str, Any]]] = {}
        self.buffered_bytes = 0
        self.oldest: float | None = None  # when the oldest unflushed row was read
        self.archived = 0
        self.consumer: RawConsumer | None = None
        self.admin = LogAdmin(cfg.broker)

    def open(self) -> "Archiver":
        """Load (and repair) the state, record the topics' shape, and assign every partition."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.state = recover(self.run_dir, ArchiveState.load(self.run_dir))
        self.admin.create_topics()  # idempotent; the archiver may start before the stages
        partitions = self.admin.list_topics()
        manifest = {"topic_prefix": self.cfg.broker.topic_prefix, "topics": {
            spec.name: {"partitions": partitions[topic_name(self.cfg.broker, spec)],
                        "max_message_bytes": spec.max_message_mb * 1024 * 1024} for spec in topics.CATALOGUE}}
        write_atomically(self.root / "manifest.json", json.dumps(manifest, indent=1).encode())
        # never commits (the state file is the position); "error" so an empty, restarted broker is
        # never silently read from another offset than the one recorded
        self.consumer = RawConsumer(self.cfg.broker, f"{self.cfg.broker.topic_prefix}archive",
                                    **{"auto.offset.reset": "error"})
        assignment = {(full, partition): self.state.offsets.get(name, {}).get(partition)
                      for full, name in self.names.items()
                      for partition in range(manifest["topics"][name]["partitions"])}
        self.consumer.assign(assignment)
        log.info("archiving %d partitions of %d topics into %s", len(assignment), len(self.names), self.root)
        return self

    def poll(self, timeout: float) -> int:
        """Buffer what arrives within ``timeout``; returns the number of new rows."""
        assert self.consumer is not None, "open() first"
        new = 0
        for msg in self.consumer.consume(timeout):
            name = self.names[msg.topic]
            expected = self.state.offsets.get(name, {}).get(msg.partition, 0)
            if msg.offset < expected:
                continue  # already archived (a re-fetch after a reconnect)
            if msg.offset > expected and expected > 0:
                log.warning("archive: %s[%d] jumps from offset %d to %d", name, msg.partition, expected, msg.offset)
            self.buffers.setdefault(name, []).append(archive_row(msg))
            self.state.offsets.setdefault(name, {})[msg.partition] = msg.offset + 1
            self.buffered_bytes += len(msg.value or b"") + len(msg.key or b"")
            self.oldest = self.oldest or time.monotonic()
            new += 1
        return new

    def due(self) -> bool:
        rows = sum(len(b) for b in self.buffers.values())
        return rows > 0 and (rows >= self.segment_records or self.buffered_bytes >= self.segment_bytes
                             or time.monotonic() - (self.oldest or 0.0) >= self.flush_s)

    def flush(self, snapshot_groups: bool = True) -> int:
        """Write one segment per topic with buffered rows, then the state; returns rows written."""
        written = 0
        for name, rows in self.buffers.items():
            if not rows:
                continue
            number = self.state.segments.get(name, 0)
            write_segment(self.root, name, number, rows)
            self.state.segments[name] = number + 1
            written += len(rows)
        self.buffers, self.buffered_bytes, self.oldest = {}, 0, None
        if snapshot_groups:
            self.snapshot_groups()
        write_atomically(self.root / "state.json", self.state.to_json())
        self.archived += written
        return written

    def snapshot_groups(self) -> None:
        """Record the committed offsets of this run's consumer groups on this run's topics.

        They live in the broker, so they are lost with it; ``replay --republish`` commits them
        again. A run's groups carry its topic prefix, as every milestream stage names them.
        """
        prefix = self.cfg.broker.topic_prefix
        try:
            ids = [g for g in self.admin.consumer_groups(prefix) if g != f"{prefix}archive"]
            self.state.groups = {**self.state.groups, **{g: o for g in ids if (o := self._committed(g))}}
            self.state.groups_at = time.time()
        except Exception as exc:  # noqa: BLE001 - a missed snapshot is retried at the next flush
            log.warning("archive: could not snapshot consumer groups: %s", exc)

    def _committed(self, group: str) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for (topic, partition), offset in self.admin.committed(group).items():
            if topic in self.names:
                out.setdefault(self.names[topic], {})[partition] = offset
        return out

    def run(self, stop: threading.Event, max_drain_s: float = 60.0) -> int:
        """Archive until ``stop`` is set, then drain until ``idle_s`` of quiet and flush; returns rows."""
        if self.consumer is None:
            self.open()
        while not stop.is_set():
            self.poll(0.2)
            if self.due():
                faults.hold("archiver.flushing")
                self.flush()
        deadline = time.monotonic() + max_drain_s
        while time.monotonic() < deadline and self.poll(self.idle_s) > 0:
            if self.due():
                self.flush()
        # the consumer groups' offsets are asked of the broker: one that is gone would only time out
        self.flush(snapshot_groups=not self.consumer.brokers_down)
        self.close()
        log.info("archived %d records this life into %s", self.archived, self.root)
        return self.archived

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None


def run_archiver(cfg: Config, stop: threading.Event, **options: Any) -> int:
    return Archiver(cfg, **options).run(stop)
