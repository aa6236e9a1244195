"""Encode and decode topic values as Arrow IPC streams, with the schema version checked.

A value is one Arrow record batch of one or more records of a single type. The schema id
(``Trajectory/1``) travels in the Arrow schema metadata and in the ``ms-schema`` Kafka header.
Every decoding failure raises :class:`RecordError`, which names topic, partition, offset and field.

Compression: the whole IPC stream is one zstd frame, unless the record type carries bytes that are
compressed already (``Record.COMPRESSED``: routing), which go as plain IPC. Arrow's own IPC
compression (a zstd call per buffer, each with a fresh context) cost ~0.5 ms to read one
1K-token trajectory and made it larger than one frame over the whole stream; decoding one frame and
reading the IPC without copying takes ~0.05 ms. Values written the old way still decode. A decoded
table points into the value's bytes, so a reader that asks for a few ``columns`` never builds the others.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Sequence, TypeVar

import pyarrow as pa
import zstandard

from milestream.schemas.records import Record

SCHEMA_HEADER = "ms-schema"
_METADATA_KEY = b"milestream.schema"
# Values are small (one record batch); Arrow's thread pool costs more than it saves on them.
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(use_threads=False)
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_LEVEL = 3
# a frame may inflate to this many times its size, and always to _MIN_INFLATE: a degenerate 32K-token
# trajectory (one token repeated) inflates ~1000x to ~0.3 MB, a forged frame never past the cap
_INFLATE_RATIO, _MIN_INFLATE = 64, 16 * 1024 * 1024
_contexts = threading.local()  # zstd contexts are not thread-safe; one pair per thread, reused

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


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    if not hasattr(_contexts, "pair"):
        _contexts.pair = zstandard.ZstdCompressor(level=_LEVEL), zstandard.ZstdDecompressor()
    return _contexts.pair


def encode(records: Sequence[Record]) -> bytes:
    if not records:
        raise ValueError("encode needs at least one record")
    cls = type(records[0])
    schema = schema_with_id(cls)
    batch = pa.RecordBatch.from_pylist([r.to_row() for r in records], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(batch)
    stream = sink.getvalue()
    return _zstd()[0].compress(stream) if not cls.COMPRESSED else stream.to_pybytes()


def _inflated(value: bytes, position: Position) -> bytes:
    limit = max(_MIN_INFLATE, _INFLATE_RATIO * len(value))
    try:
        declared = zstandard.frame_content_size(value)
        if declared > limit:
            raise zstandard.ZstdError(f"the frame declares {declared} bytes, past the {limit} allowed")
        return _zstd()[1].decompress(value, max_output_size=limit)
    except zstandard.ZstdError as exc:
        raise RecordError(position, "<value>", f"not a zstd frame of an Arrow IPC stream: {exc}") from None


def decode_table(value: bytes | None, cls: type[Record], position: Position = Position(),
                 columns: Sequence[str] | None = None, nulls: bool = True) -> pa.Table:
    """The value as an Arrow table of ``cls`` records, or RecordError naming what is wrong. With ``columns``
    only those are checked for nulls and returned (the schema is checked whole); ``nulls=False`` leaves the
    null check to the caller (``check_nulls``: once over many values)."""
    if value is None:
        raise RecordError(position, "<value>", "empty value (tombstone)")
    stream = _inflated(value, position) if value[:4] == _ZSTD_MAGIC else value
    try:
        table = pa.ipc.open_stream(pa.py_buffer(stream), options=_READ_OPTIONS).read_all()
        table.validate(full=True)  # offsets inside their buffers: its columns are read in place, not copied
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise RecordError(position, "<value>", f"not an Arrow IPC stream: {exc}") from None
    found = (table.schema.metadata or {}).get(_METADATA_KEY, b"<none>").decode(errors="replace")
    if found != cls.schema_id():
        table = _upgraded(table, found, cls, position)
    if not table.schema.equals(cls.SCHEMA):  # the checks that name the field, off the common path
        _check_schema(table.schema, cls, position)
        table = table.select(cls.SCHEMA.names)  # the same fields in another order (an upgraded value)
    if table.num_rows == 0:
        raise RecordError(position, "<value>", "no records")
    if columns is not None:
        table = table.select(list(columns))
    if nulls:
        check_nulls(table, cls, position, table.column_names)
    return table


def check_nulls(table: pa.Table, cls: type[Record], position: Position, columns: Sequence[str]) -> None:
    """RecordError naming the first of ``columns`` that holds a null where ``cls`` admits none."""
    for name, nullable in _nullable(cls):
        if name in columns and _has_nulls(table.column(name), inner_only=nullable):
            raise RecordError(position, name, "null, where the record type admits none")


def _check_schema(schema: pa.Schema, cls: type[Record], position: Position) -> None:
    for expected in cls.SCHEMA:
        if expected.name not in schema.names:
            raise RecordError(position, expected.name, "missing")
        actual = schema.field(expected.name).type
        if actual != expected.type:
            raise RecordError(position, expected.name, f"type {actual}, expected {expected.type}")
    for name in schema.names:
        if name not in cls.SCHEMA.names or schema.names.count(name) > 1:
            raise RecordError(position, name, f"not a field of {cls.schema_id()} (or given twice)")


@functools.cache
def _nullable(cls: type[Record]) -> tuple[tuple[str, bool], ...]:
    """(field, whether its annotation admits None) of each field: an Arrow column admits nulls at every
    level, a record only where its type says (``topk_ids: list[list[int]] | None``: the list, not its values)."""
    return tuple((f.name, "None" in str(f.type)) for f in dataclasses.fields(cls))


def _has_nulls(column: pa.ChunkedArray | pa.Array, inner_only: bool = False) -> bool:
    """Nulls in the column (``inner_only``: only below its top level), in its lists and maps at any depth (a list's
    child array whole: a null in a slot no list covers is refused too, which no writer of ours makes)."""
    for chunk in column.chunks if isinstance(column, pa.ChunkedArray) else (column,):
        if chunk.null_count and not inner_only:
            return True
        kind = chunk.type.id
        if kind == _MAP:
            if _has_nulls(chunk.keys) or _has_nulls(chunk.items):
                return True
        elif kind in _LISTS and _has_nulls(chunk.values):
            return True
    return False


_MAP = pa.map_(pa.string(), pa.string()).id
_LISTS = (pa.list_(pa.int8()).id, pa.large_list(pa.int8()).id)


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
    return _records(decode_table(value, cls, position), cls, position)


def decode_values(values: Sequence[tuple[bytes | None, Position]], cls: type[R]) -> list[list[R] | RecordError]:
    """``decode`` of many values of one type: per value its records, or the RecordError that refuses it. The
    values' rows become Python objects in one pass (and are checked for nulls in one), so a batch of small
    values pays the per-call costs once."""
    out: list[list[R] | RecordError] = [[] for _ in values]
    tables: list[tuple[int, pa.Table]] = []
    for index, (value, position) in enumerate(values):
        try:
            tables.append((index, decode_table(value, cls, position, nulls=False)))
        except RecordError as exc:
            out[index] = exc
    try:
        table = pa.concat_tables([t for _, t in tables]) if tables else None
        if table is not None and not cls.COMPRESSED:  # small values: one contiguous table
            table = table.combine_chunks()
        if table is not None:
            check_nulls(table, cls, Position(), table.column_names)
    except (RecordError, pa.ArrowException):  # a null somewhere, or tables that do not concatenate: one by one
        for index, table in tables:
            try:
                check_nulls(table, cls, values[index][1], table.column_names)
                out[index] = _records(table, cls, values[index][1])
            except RecordError as exc:
                out[index] = exc
        return out
    if table is not None:
        rows, start = _records(table, cls, Position()), 0
        for index, part in tables:
            out[index], start = rows[start:start + part.num_rows], start + part.num_rows
    return out


def _records(table: pa.Table, cls: type[R], position: Position) -> list[R]:
    records = []
    for index, row in enumerate(table.to_pylist()):
        try:
            records.append(cls.from_row(row))
        except (TypeError, ValueError) as exc:
            raise RecordError(position, f"<row {index}>", str(exc)) from None
    return records


def headers_for(cls: type[Record]) -> list[tuple[str, bytes]]:
    return [(SCHEMA_HEADER, cls.schema_id().encode())]
