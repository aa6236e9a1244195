"""What the processor reads of a rollout record, and the rules each record keeps on its own.

A rollout value (rollout.trajectories, rollout.logprobs, rollout.routing, and under on-policy distillation
rollout.teacher_logprobs) is checked as an Arrow table, column by column in bulk (numpy over the flattened
lists), and only its small fields become Python objects: a ``TrajectoryRef``, ``LogProbsRef`` (the
teacher's too) or ``RoutingRef`` per record, with where the record lies.
Token lists, log-probs and routing bytes are never built into rows here; the trainer reads them from
the same place later (train/collector.py) and checks them again with the same function before it
builds its samples.

The rules (a record that decodes can still be hostile): the run's group size, a sample index inside it,
the trajectory id its group, index and leaf make (a leaf inside its sample's count of leaves), a known status, a loss mask of 0/1 as long as the response,
no negative token id or version, finite reward and times, a plausible routing chunk count; log-probs
never NaN nor above 0 (-inf is a token the engine found impossible: the loss guards it), top-k ids and
log-probs of one shape; a routing chunk inside its count, a known layout and compression, and a zstd
frame that declares no more bytes than its layout holds (a bomb is refused unread).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import zstandard

from milestream.schemas.codec import Position, RecordError, check_nulls, decode_table
from milestream.schemas.records import LogProbs, Record, Routing, TeacherLogProbs, Trajectory, leaf_of
from milestream.schemas.routing import COMPRESSION, PLAIN_COMPRESSION

At = tuple[int, int, int]  # (partition, offset, row in the value)


class MismatchError(ValueError):
    """A record that breaks a rule or does not fit its group; ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True, slots=True)
class TrajectoryRef:
    trajectory_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    reward: float
    status: str
    engine_id: str
    worker_id: str
    submitted_at: float
    finished_at: float
    routing_chunks: int
    reward_error: str
    error: str
    prompt_tokens: int
    response_tokens: int
    min_version: int  # -1: no response token
    max_version: int
    at: At
    leaf: int = 0
    leaves: int = 1


@dataclass(frozen=True, slots=True)
class LogProbsRef:
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    tokens: int
    at: At
    teacher: bool = False  # a TeacherLogProbs record (on-policy distillation), not the rollout engine's


@dataclass(frozen=True, slots=True)
class RoutingRef:
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    chunk_index: int
    num_chunks: int
    at: At


SourceRef = TrajectoryRef | LogProbsRef | RoutingRef
_IDS = ("trajectory_id", "group_id", "sample_index", "group_size")
_TRAJECTORY_SCALARS = ("prompt_id", "reward", "status", "engine_id", "worker_id", "submitted_at", "finished_at",
                       "routing_chunks", "reward_error", "error", "leaf", "leaves")
# response_text is the one column nothing here reads
TRAJECTORY_COLUMNS = tuple(name for name in Trajectory.SCHEMA.names if name != "response_text")


def read_values(values: Sequence[tuple[bytes | None, Position]], cls: type[Record],
                group_size: int) -> list[list[SourceRef] | RecordError]:
    """Per value (in order) the refs of its records, or the RecordError that refuses it. The values are decoded
    one by one and their rules checked over all of them at once, so a batch pays each check's fixed cost once;
    when some value breaks a rule, each is checked alone to name it."""
    columns = TRAJECTORY_COLUMNS if cls is Trajectory else None
    out: list[list[SourceRef] | RecordError] = [[] for _ in values]
    decoded: list[tuple[int, pa.Table]] = []
    for index, (value, position) in enumerate(values):
        try:
            decoded.append((index, decode_table(value, cls, position, columns, nulls=False)))
        except RecordError as exc:
            out[index] = exc
    if not decoded:
        return out
    try:
        refs = _checked([table for _, table in decoded], [values[i][1] for i, _ in decoded], cls, group_size)
    except (RecordError, MismatchError, pa.ArrowException):  # (tables of other schema variants do not concatenate)
        for index, table in decoded:
            out[index] = _checked_alone(table, values[index][1], cls, group_size)
        return out
    for (index, table), start in zip(decoded, itertools.accumulate((t.num_rows for _, t in decoded), initial=0)):
        out[index] = refs[start:start + table.num_rows]
    return out


def _checked(tables: list[pa.Table], positions: list[Position], cls: type[Record], group_size: int) -> list[SourceRef]:
    table = pa.concat_tables(tables)
    if not cls.COMPRESSED:  # small values: one contiguous table (routing's large bytes stay where they are)
        table = table.combine_chunks()
    check_nulls(table, cls, positions[0] if len(positions) == 1 else Position(), table.column_names)
    ats = [(p.partition, p.offset, row) for t, p in zip(tables, positions) for row in range(t.num_rows)]
    return check_table(table, cls, ats, group_size)


def _checked_alone(table: pa.Table, position: Position, cls: type[Record], group_size: int) -> list[SourceRef] | RecordError:
    try:
        return _checked([table], [position], cls, group_size)
    except RecordError as exc:
        return exc
    except MismatchError as exc:
        return RecordError(position, exc.field, str(exc))


def check_table(table: pa.Table, cls: type[Record], ats: Sequence[At], group_size: int) -> list[SourceRef]:
    """Every rule of ``cls`` over a decoded table (``ats``: where each row lies); its refs, or MismatchError
    naming the field."""
    ids = {name: table.column(name).to_pylist() for name in _IDS}
    ids["leaf"] = _check_ids(ids, group_size)
    return _READERS[cls](table, ids, ats)


def _check_ids(ids: dict[str, list], group_size: int) -> list[int]:
    """Each row's leaf, as its trajectory id names it."""
    leaves = []
    for trajectory_id, group_id, index, size in zip(*(ids[name] for name in _IDS)):
        if size != group_size:
            raise MismatchError("group_size", f"group size {size}, the run's is {group_size}")
        if not 0 <= index < group_size:
            raise MismatchError("sample_index", f"sample {index} of a group of {group_size}")
        leaf = leaf_of(trajectory_id, group_id, index)
        if leaf is None:
            raise MismatchError("trajectory_id", f"{trajectory_id!r} is not sample {index} of group {group_id!r}")
        leaves.append(leaf)
    return leaves


@dataclass(frozen=True)
class _Lists:
    """One list column as numpy: each row's length and start, and every value."""

    lengths: np.ndarray
    starts: np.ndarray
    values: np.ndarray

    @classmethod
    def of(cls, column: pa.ChunkedArray) -> "_Lists":
        array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        offsets = array.offsets.to_numpy()
        first = int(offsets[0])
        values = array.values.slice(first, int(offsets[-1]) - first).to_numpy(zero_copy_only=False)
        return cls(np.diff(offsets), offsets[:-1] - first, values)

    def reduced(self, ufunc: np.ufunc, empty: int) -> list[int]:
        """``ufunc`` reduced over each row (``empty`` for an empty one)."""
        filled = self.lengths > 0
        out = [empty] * len(self.lengths)
        if filled.any():  # reduceat over the non-empty rows' starts: each range is exactly one row's values
            for i, value in zip(np.flatnonzero(filled), ufunc.reduceat(self.values, self.starts[filled])):
                out[i] = int(value)
        return out


def _trajectories(table: pa.Table, ids: dict[str, list], ats: Sequence[At]) -> list[SourceRef]:
    scalars = {name: table.column(name).to_pylist() for name in _TRAJECTORY_SCALARS}
    lists = {name: _Lists.of(table.column(name)) for name in ("prompt_ids", "response_ids", "loss_mask",
                                                                 "token_versions")}
    response = lists["response_ids"].lengths
    for name in ("loss_mask", "token_versions"):
        if not np.array_equal(lists[name].lengths, response):
            raise MismatchError(name, f"{lists[name].lengths.tolist()} values for {response.tolist()} response tokens")
    if np.any((lists["loss_mask"].values != 0) & (lists["loss_mask"].values != 1)):
        raise MismatchError("loss_mask", "values other than 0 and 1")
    for name in ("prompt_ids", "response_ids", "token_versions"):
        if len(lists[name].values) and lists[name].values.min() < 0:
            raise MismatchError(name, "a negative value")
    for status, chunks, tokens, *times in zip(scalars["status"], scalars["routing_chunks"],
                                              lists["prompt_ids"].lengths + response, scalars["reward"],
                                              scalars["submitted_at"], scalars["finished_at"]):
        _check_trajectory_row(status, chunks, int(tokens), times)
    for named, leaf, leaves in zip(ids["leaf"], scalars["leaf"], scalars["leaves"]):
        if not named == leaf < leaves:
            raise MismatchError("leaf", f"leaf {leaf} of {leaves}, its trajectory id names leaf {named}")
    versions = lists["token_versions"]
    oldest, newest = versions.reduced(np.minimum, -1), versions.reduced(np.maximum, -1)
    return [TrajectoryRef(ids["trajectory_id"][i], ids["group_id"][i], scalars["prompt_id"][i], ids["sample_index"][i],
                          ids["group_size"][i], scalars["reward"][i], scalars["status"][i], scalars["engine_id"][i],
                          scalars["worker_id"][i], scalars["submitted_at"][i], scalars["finished_at"][i],
                          scalars["routing_chunks"][i], scalars["reward_error"][i], scalars["error"][i],
                          int(lists["prompt_ids"].lengths[i]), int(response[i]), oldest[i], newest[i], ats[i],
                          scalars["leaf"][i], scalars["leaves"][i])
            for i in range(table.num_rows)]


def _check_trajectory_row(status: str, routing_chunks: int, tokens: int, times: list[float]) -> None:
    if status not in Trajectory.STATUSES:
        raise MismatchError("status", f"status {status!r} is not one of {Trajectory.STATUSES}")
    for name, value in zip(("reward", "submitted_at", "finished_at"), times):
        if not math.isfinite(value):
            raise MismatchError(name, f"{value} is not finite")
    if not 0 <= routing_chunks <= max(1, tokens):
        raise MismatchError("routing_chunks", f"{routing_chunks} routing chunks for {tokens} tokens")


def _logprobs(table: pa.Table, ids: dict[str, list], ats: Sequence[At], teacher: bool = False) -> list[SourceRef]:
    logprobs = _Lists.of(table.column("logprobs"))
    if not np.all(logprobs.values <= 0.0):  # NaN compares false
        raise MismatchError("logprobs", f"a NaN or positive {'teacher ' if teacher else ''}log-prob")
    if not teacher:
        topk_ids, topk_logprobs = table.column("topk_ids"), table.column("topk_logprobs")
        if topk_ids.null_count != table.num_rows or topk_logprobs.null_count != table.num_rows:
            _check_topk(topk_ids.to_pylist(), topk_logprobs.to_pylist(), logprobs.lengths.tolist())
    return [LogProbsRef(ids["trajectory_id"][i], ids["group_id"][i], ids["sample_index"][i], ids["group_size"][i],
                        int(logprobs.lengths[i]), ats[i], teacher)
            for i in range(table.num_rows)]


def _check_topk(topk_ids: list, topk_logprobs: list, lengths: list[int]) -> None:
    for rows, values, tokens in zip(topk_ids, topk_logprobs, lengths):
        if (rows is None) != (values is None):
            raise MismatchError("topk_ids", "top-k ids and log-probs come together")
        if rows is not None and (len(rows) != tokens or [len(r) for r in rows] != [len(v) for v in values]):
            raise MismatchError("topk_ids", "top-k ids and log-probs differ in shape from each other or the tokens")


def _routing(table: pa.Table, ids: dict[str, list], ats: Sequence[At]) -> list[SourceRef]:
    fields = {name: table.column(name).to_pylist()
              for name in ("chunk_index", "num_chunks", "num_tokens", "num_layers", "top_k", "id_bytes", "compression")}
    data = table.column("data")
    refs = []
    for i in range(table.num_rows):
        row = {name: values[i] for name, values in fields.items()}
        check_routing_chunk(row, data[i].as_buffer())  # the bytes where they lie, not copied
        refs.append(RoutingRef(ids["trajectory_id"][i], ids["group_id"][i], ids["sample_index"][i],
                               ids["group_size"][i], row["chunk_index"], row["num_chunks"], ats[i]))
    return refs


def check_routing_chunk(row: dict, data: pa.Buffer | bytes) -> None:
    """A chunk's layout, and the size its zstd frame declares; a frame that declares none is inflated to check
    (within its layout's size: the size a frame declares wins over ``max_output_size``)."""
    if not 0 <= row["chunk_index"] < row["num_chunks"]:
        raise MismatchError("chunk_index", f"chunk {row['chunk_index']} of {row['num_chunks']}")
    layout = [row["num_tokens"], row["num_layers"], row["top_k"], row["id_bytes"]]
    if row["id_bytes"] not in (1, 2) or min(layout[:3]) < 0:
        raise MismatchError("id_bytes", f"layout {layout}")
    if row["compression"] not in (COMPRESSION, PLAIN_COMPRESSION):
        raise MismatchError("compression", f"unknown routing compression {row['compression']!r}")
    ids_bytes = row["num_layers"] * row["top_k"] * row["id_bytes"]
    whole = row["num_tokens"] * ids_bytes
    try:
        size = zstandard.frame_content_size(data)
        if size < 0:
            size = len(zstandard.ZstdDecompressor().decompress(data, max_output_size=whole + 1))
    except zstandard.ZstdError as exc:
        raise MismatchError("data", f"routing data is no zstd frame within its layout: {exc}") from None
    if size > whole or (ids_bytes and size % ids_bytes):
        raise MismatchError("data", f"{size} bytes of routing for layout {layout}")


_READERS: dict[type[Record], Callable[[pa.Table, dict[str, list], Sequence[At]], list[SourceRef]]] = {
    Trajectory: _trajectories, LogProbs: _logprobs, Routing: _routing, TeacherLogProbs: functools.partial(_logprobs, teacher=True),
}


def refs_of(records: list[Record], cls: type[Record], partition: int, offset: int, group_size: int) -> list[SourceRef]:
    """The refs of decoded records (an offline re-drive, a test), checked as the processor checks a value."""
    table = pa.Table.from_pylist([r.to_row() for r in records], schema=cls.SCHEMA)
    return check_table(table, cls, [(partition, offset, row) for row in range(len(records))], group_size)
