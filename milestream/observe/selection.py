"""A run's trajectories as one table, selected by step, group, time or offset, and exported to Parquet.

One row per trajectory sample on ``rollout.trajectories`` (the first record of a trajectory id; a
re-published duplicate is the same sample), joined with its log-probs from ``rollout.logprobs`` and
with what became of its group:

=====================  ====================================================================================
column                 meaning
=====================  ====================================================================================
group_id               the group (``PROMPT#ATTEMPT``); ``trajectory_id`` = ``GROUP/SAMPLE`` (``.LEAF``)
prompt_id              the prompt; ``sample_index`` and ``group_size`` place the sample in its group;
                       ``leaf`` of ``leaves``: which trajectory of an agent's episode (0 of 1 otherwise)
outcome                ``trained`` (a step of the lineage trained it), ``dropped`` (buffer.dropped),
                       ``buffered`` (on buffer.groups, not trained when the run stopped) or ``pending``
                       (the processor had not completed the group)
step, staleness        the trainer step that trained the group and the group's staleness then (null if not)
drop_reason            aborted / filtered / stale / incomplete, with ``drop_detail`` and ``dropped_by``
                       (processor or trainer); null unless dropped
reward, status         the verifier's reward; completed / truncated / aborted
engine_id, worker_id   who generated it; ``submitted_at`` / ``finished_at``: unix seconds
partition, offset      its rollout.trajectories record; ``timestamp_ms`` is that record's broker timestamp
group_partition,       its group's buffer.groups record (null if the group was never emitted)
group_offset
prompt_text            the prompt ids decoded with the run's tokenizer (chat template included)
response_text          the response ids decoded, special tokens kept
num_response_tokens    length of the per-token lists below
response_ids           token ids; ``response_tokens``: each one decoded alone
logprobs               behaviour log-prob of each response token (null if none was logged)
topk_ids,              the engine's k likeliest tokens at each position and their log-probs
topk_logprobs          (rollout.logprobs_topk; null or empty when it logged none)
token_versions         the weight version that produced each token; ``min_version`` / ``max_version``
loss_mask              1 where the token counts in the loss
=====================  ====================================================================================
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from milestream.config import UserError
from milestream.log.lineage import GroupFate, lineage_of
from milestream.log.reader import LogSource, LoggedMessage
from milestream.observe.show import when
from milestream.schemas import topics
from milestream.schemas.records import LogProbs, Metrics, Record, Trajectory

Decoder = Callable[[list[int]], str]

SAMPLE_SCHEMA = pa.schema([
    ("group_id", pa.string()), ("trajectory_id", pa.string()), ("prompt_id", pa.string()),
    ("sample_index", pa.int32()), ("group_size", pa.int32()), ("leaf", pa.int32()), ("leaves", pa.int32()),
    ("outcome", pa.string()),
    ("step", pa.int64()), ("staleness", pa.int32()), ("drop_reason", pa.string()), ("drop_detail", pa.string()),
    ("dropped_by", pa.string()), ("reward", pa.float32()), ("status", pa.string()), ("engine_id", pa.string()),
    ("worker_id", pa.string()), ("submitted_at", pa.float64()), ("finished_at", pa.float64()),
    ("partition", pa.int32()), ("offset", pa.int64()), ("timestamp_ms", pa.int64()),
    ("group_partition", pa.int32()), ("group_offset", pa.int64()),
    ("prompt_text", pa.string()), ("response_text", pa.string()), ("num_response_tokens", pa.int32()),
    ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
    ("response_tokens", pa.list_(pa.string())), ("logprobs", pa.list_(pa.float32())),
    ("topk_ids", pa.list_(pa.list_(pa.int32()))), ("topk_logprobs", pa.list_(pa.list_(pa.float32()))),
    ("token_versions", pa.list_(pa.int32())), ("min_version", pa.int32()), ("max_version", pa.int32()),
    ("loss_mask", pa.list_(pa.int8())),
])


BY_TRAJECTORY = (topics.TRAJECTORIES, topics.LOGPROBS, topics.ROUTING)  # an offset names samples
BY_GROUP = (topics.PROMPTS, topics.GROUPS, topics.DROPPED, topics.METRICS)  # an offset names groups


class SelectionError(UserError, ValueError):
    """A selection that is malformed, or that nothing on the log meets."""


def group_fates(source: LogSource) -> dict[str, GroupFate]:
    """Each group's fate (log/lineage.py); with no trainer checkpoint here, an emitted group without an
    outcome counts as buffered."""
    return lineage_of(m for spec in (topics.GROUPS, topics.DROPPED, topics.METRICS)
                      for m in source.messages(spec)).fates()


def _first_by_trajectory(messages: Iterable[LoggedMessage]) -> dict[str, tuple[LoggedMessage, Record]]:
    out: dict[str, tuple[LoggedMessage, Record]] = {}
    for m in messages:
        for record in m.records:
            out.setdefault(record.trajectory_id, (m, record))
    return out


def _sample_row(message: LoggedMessage, t: Trajectory, logprobs: LogProbs | None, fate: GroupFate,
                decode_text: Decoder, prompt_text: str) -> dict[str, Any]:
    drop = fate.drop
    return {
        **{name: getattr(t, name) for name in ("group_id", "trajectory_id", "prompt_id", "sample_index", "group_size",
                                               "leaf", "leaves", "reward", "status", "engine_id", "worker_id",
                                               "submitted_at", "finished_at", "prompt_ids", "response_ids",
                                               "token_versions", "loss_mask")},
        "outcome": fate.outcome, "step": fate.step, "staleness": fate.staleness,
        "drop_reason": drop and drop.reason, "drop_detail": drop and drop.detail, "dropped_by": drop and drop.dropped_by,
        "partition": message.partition, "offset": message.offset, "timestamp_ms": message.timestamp_ms,
        "group_partition": fate.emitted_at and fate.emitted_at[0], "group_offset": fate.emitted_at and fate.emitted_at[1],
        "prompt_text": prompt_text, "response_text": decode_text(t.response_ids),
        "num_response_tokens": len(t.response_ids), "response_tokens": [decode_text([i]) for i in t.response_ids],
        **{name: None if logprobs is None else getattr(logprobs, name) for name in ("logprobs", "topk_ids",
                                                                                     "topk_logprobs")},
        "min_version": min(t.token_versions, default=None), "max_version": max(t.token_versions, default=None),
    }


def sample_table(source: LogSource, decode_text: Decoder) -> pa.Table:
    """Every trajectory sample of the log with its decoded text and its group's fate (columns above)."""
    fates = group_fates(source)
    logprobs = {tid: record for tid, (_, record) in _first_by_trajectory(source.messages(topics.LOGPROBS)).items()}
    prompts: dict[tuple[int, ...], str] = {}
    rows = []
    for tid, (message, t) in _first_by_trajectory(source.messages(topics.TRAJECTORIES)).items():
        key = tuple(t.prompt_ids)
        if key not in prompts:
            prompts[key] = decode_text(t.prompt_ids)
        rows.append(_sample_row(message, t, logprobs.get(tid), fates.get(t.group_id, GroupFate("pending")),
                                decode_text, prompts[key]))
    return pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)


@dataclass(frozen=True)
class OffsetRange:
    """Records ``first`` to ``last`` (inclusive) of one topic-partition."""

    topic: str
    partition: int
    first: int
    last: int


@dataclass(frozen=True)
class Selection:
    """Which samples to keep; every criterion given must hold (an empty selection keeps all)."""

    steps: tuple[int, int] | None = None  # inclusive: the groups these trainer steps trained
    group_ids: frozenset[str] = field(default_factory=frozenset)
    since_ms: int | None = None  # rollout.trajectories timestamps, since inclusive, until exclusive
    until_ms: int | None = None
    offsets: OffsetRange | None = None
    sample_index: int | None = None

    def apply(self, table: pa.Table, source: LogSource) -> pa.Table:
        return _meeting(table, self._criteria(table, source))

    def pick(self, table: pa.Table, source: LogSource) -> pa.Table:
        """As ``apply``; SelectionError when a selection was given and nothing on the log meets it, naming
        each criterion nothing meets and what the log holds instead."""
        criteria = self._criteria(table, source)
        chosen = _meeting(table, criteria)
        if chosen.num_rows or not criteria:
            return chosen
        if not table.num_rows:
            raise SelectionError("nothing selected: the log holds no trajectory sample")
        unmet = [f"{c.asked}: none on the log ({c.holds})" for c in criteria
                 if not pc.any(pc.fill_null(c.mask, False)).as_py()]
        if not unmet:
            unmet = [f"each of {', '.join(c.asked for c in criteria)} is met by some sample, no sample meets all"]
        raise SelectionError(f"nothing selected from the {table.num_rows} samples of the log: " + "; ".join(unmet))

    def _criteria(self, table: pa.Table, source: LogSource) -> list["Criterion"]:
        """Each criterion given, over ``table``; what the log holds is worded for a table with rows."""
        out = []
        if self.steps is not None:
            first, last = self.steps
            trained = table.filter(pc.is_valid(table["step"]))["step"]
            out.append(Criterion(
                f"step {first}" if first == last else f"steps {first}:{last}",
                pc.and_(pc.greater_equal(table["step"], first), pc.less_equal(table["step"], last)),
                f"the trained steps are {_span(trained)}" if len(trained) else "no step trained a logged group"))
        if self.group_ids:
            example = table["group_id"][0].as_py() if table.num_rows else None
            out.append(Criterion(f"group {', '.join(sorted(self.group_ids))}",
                                 pc.is_in(table["group_id"], pa.array(sorted(self.group_ids))),
                                 f"its group ids look like {example!r}; --list lists them"))
        stamps = table["timestamp_ms"]
        stamped = f"its records are stamped {when(pc.min(stamps).as_py())} to {when(pc.max(stamps).as_py())}"
        if self.since_ms is not None:
            out.append(Criterion(f"records stamped at or after {when(self.since_ms)}",
                                 pc.greater_equal(stamps, self.since_ms), stamped))
        if self.until_ms is not None:
            out.append(Criterion(f"records stamped before {when(self.until_ms)}", pc.less(stamps, self.until_ms),
                                 stamped))
        if self.offsets is not None:
            column, ids = ids_in_range(source, self.offsets)
            span = self.offsets
            out.append(Criterion(f"{span.topic}[{span.partition}]@{span.first}:{span.last}",
                                 pc.is_in(table[column], pa.array(sorted(ids), pa.string())),
                                 "those offsets name no logged sample"))
        if self.sample_index is not None:
            out.append(Criterion(f"sample {self.sample_index}", pc.equal(table["sample_index"], self.sample_index),
                                 f"its groups have {_span(table['group_size'])} samples, indices from 0"))
        return out


@dataclass(frozen=True)
class Criterion:
    """One criterion of a selection over a table: what was asked, in words; its mask; what the log holds."""

    asked: str
    mask: Any  # a boolean (chunked) array over the table's rows
    holds: str


def _meeting(table: pa.Table, criteria: list[Criterion]) -> pa.Table:
    """The rows of ``table`` that meet every criterion (all of them, with none)."""
    if not criteria:
        return table
    keep = criteria[0].mask
    for criterion in criteria[1:]:
        keep = pc.and_(keep, criterion.mask)
    return table.filter(pc.fill_null(keep, False))


def _span(values: Any) -> str:
    low, high = pc.min(values).as_py(), pc.max(values).as_py()
    return str(low) if low == high else f"{low} to {high}"


def ids_in_range(source: LogSource, span: OffsetRange) -> tuple[str, set[str]]:
    """The samples an offset range covers: ("trajectory_id", ids) for rollout records, else ("group_id", ids)."""
    try:
        spec = topics.by_name(span.topic)
    except KeyError as exc:
        raise SelectionError(str(exc)) from None
    if spec not in BY_TRAJECTORY + BY_GROUP:
        raise SelectionError(f"topic {span.topic} carries no group ids; select by offset on one of "
                             f"{[s.name for s in BY_TRAJECTORY + BY_GROUP]}")
    records = [r for m in source.messages(spec) if m.partition == span.partition and span.first <= m.offset <= span.last
               for r in m.records]
    if spec in BY_TRAJECTORY:
        return "trajectory_id", {r.trajectory_id for r in records}
    return "group_id", {g for r in records for g in (r.group_ids if isinstance(r, Metrics) else [r.group_id])}


def parse_time(text: str) -> int:
    """Unix seconds (``1764553200.5``) or ISO 8601 (``2026-12-01T02:19:04``, local time if no zone) -> ms."""
    try:
        return round(float(text) * 1000)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise SelectionError(f"time {text!r}: neither unix seconds nor ISO 8601") from None
    return round(moment.astimezone().timestamp() * 1000)


def parse_span(text: str, what: str) -> tuple[int, int]:
    """``N`` or ``A:B`` (inclusive) -> (first, last)."""
    first, _, last = text.partition(":")
    try:
        span = (int(first), int(last or first))
    except ValueError:
        raise SelectionError(f"{what} {text!r}: expected N or A:B") from None
    if span[0] > span[1]:
        raise SelectionError(f"{what} {text!r}: the range is empty")
    return span


def export_parquet(table: pa.Table, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd")
    return path
