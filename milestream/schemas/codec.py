"""Encode and decode topic values as Arrow IPC streams (zstd), with the schema version checked.

A value is one Arrow record batch of one or more records of a single type. The schema id
(``Trajectory/1``) travels in the Arrow schema metadata and in the ``ms-schema`` Kafka header.
Every decoding failure raises :class:`RecordError`, which names topic, partition, offset and field.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence, TypeVar

import pyarrow as pa

from milestream.schemas.records import Record

SCHEMA_HEADER = "ms-schema"
_METADATA_KEY = b"milestream.schema"
# Values are small (one record batch); Arrow's thread pool costs more than it saves on them.
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)

R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class Position:
    """Where a value came from, for error messages and dead letters."""

    topic: str = "?"
    partition: int = -1
    offset: int = -1

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class RecordError(ValueError):
    def __init__(self, position: Position, field: str, reason: str):
        self.position, self.field, self.reason = position, field, reason
        super().__init__(f"record at {position}: field {field!r}: {reason}")


def schema_with_id(cls: type[Record]) -> pa.Schema:
    return cls.SCHEMA.with_metadata({_METADATA_KEY: cls.schema_id().encode()})


def encode(records: Sequence[Record]) -> bytes:
    if not records:
        raise ValueError("encode needs at least one record")
    cls = type(records[0])
    schema = schema_with_id(cls)
    batch = pa.RecordBatch.from_pylist([r.to_row() for r in records], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_table(value: bytes | None, cls: type[Record], position: Position = Position()) -> pa.Table:
    """The value as an Arrow table of ``cls`` records, or RecordError naming what is wrong."""
    if value is None:
        raise RecordError(position, "<value>", "empty value (tombstone)")
    try:
        table = pa.ipc.open_stream(pa.py_buffer(value), options=_READ_OPTIONS).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise RecordError(position, "<value>", f"not an Arrow IPC stream: {exc}") from None
    found = (table.schema.metadata or {}).get(_METADATA_KEY, b"<none>").decode(errors="replace")
    if found != cls.schema_id():
        table = _upgraded(table, found, cls, position)
    for expected in cls.SCHEMA:
        if expected.name not in table.schema.names:
            raise RecordError(position, expected.name, "missing")
        actual = table.schema.field(expected.name).type
        if actual != expected.type:
            raise RecordError(position, expected.name, f"type {actual}, expected {expected.type}")
    for name in table.schema.names:
        if name not in cls.SCHEMA.names or table.schema.names.count(name) > 1:
            raise RecordError(position, name, f"not a field of {cls.schema_id()} (or given twice)")
    if table.num_rows == 0:
        raise RecordError(position, "<value>", "no records")
    for name, nullable in _nullable(cls):
        if _has_nulls(table.column(name), inner_only=nullable):
            raise RecordError(position, name, "null, where the record type admits none")
    return table


@functools.cache
def _nullable(cls: type[Record]) -> tuple[tuple[str, bool], ...]:
    """(field, whether its annotation admits None) of each field: an Arrow column admits nulls at every
    level, a record only where its type says (``topk_ids: list[list[int]] | None``: the list, not its values)."""
    return tuple((f.name, "None" in str(f.type)) for f in dataclasses.fields(cls))


def _has_nulls(column: pa.ChunkedArray | pa.Array, inner_only: bool = False) -> bool:
    """Nulls in the column (``inner_only``: only below its top level), in its lists and maps at any depth."""
    for chunk in column.chunks if isinstance(column, pa.ChunkedArray) else [column]:
        if chunk.null_count and not inner_only:
            return True
        if isinstance(chunk, pa.MapArray):
            if _has_nulls(chunk.keys) or _has_nulls(chunk.items):
                return True
        elif isinstance(chunk, (pa.ListArray, pa.LargeListArray)) and _has_nulls(chunk.flatten()):
            return True
    return False


def _upgraded(table: pa.Table, found: str, cls: type[Record], position: Position) -> pa.Table:
    """A value written under an older version of ``cls``: the fields added since take their defaults
    (a version may only add fields that have one), so a run logged before an upgrade still resumes."""
    name, _, version = found.partition("/")
    if name != cls.__name__ or not version.isdigit() or not 1 <= int(version) < cls.VERSION:
        raise RecordError(position, "<schema>", f"schema {found!r}, expected {cls.schema_id()!r}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    for expected in cls.SCHEMA:
        if expected.name not in table.schema.names and expected.name in defaults:
            table = table.append_column(expected, pa.array([defaults[expected.name]] * len(table), expected.type))
    return table


def decode(value: bytes | None, cls: type[R], position: Position = Position()) -> list[R]:
    table = decode_table(value, cls, position)
    records = []
    for index, row in enumerate(table.to_pylist()):
        try:
            records.append(cls.from_row(row))
        except (TypeError, ValueError) as exc:
            raise RecordError(position, f"<row {index}>", str(exc)) from None
    return records


def headers_for(cls: type[Record]) -> list[tuple[str, bytes]]:
    return [(SCHEMA_HEADER, cls.schema_id().encode())]
