"""Taking groups out of the buffer for a training step: the trainer's side of the buffer.

``buffer.groups`` carries each group's manifest (schemas/records.py ``GroupManifest``: per sample the fields
the rules read and where its records lie on the rollout topics). Manifests wait in a local pool, small
whatever the groups' size; a data selector (an import path) picks each batch from the pool. At collection
a group past the staleness window (``cfg.staleness_bound``: 0 in the sync schedule, 1 in one_step) is
dropped onto ``buffer.dropped`` (Miles' third drop rule) without its records ever being read. The records
of the groups chosen are read where their manifests say, in one pass over the whole batch's positions
(``infra.kafka.PositionReader``), each checked to be the record its manifest describes, and joined into
the samples a step trains on (streams/groups.py ``join_sample``); so the trainer holds the records of
one batch at a time, however long the buffer. A group leaves the buffer — its credit returns — when it is
taken or dropped; in the sync and one_step schedules the version floor is raised first, so the credit of
a batch admits only prompts a new enough engine takes. The offsets to checkpoint stop below the oldest
group still in the pool, so a resumed trainer re-reads what it had not used, and skips by id what it had.

A manifest the processor did not send (its group id never settled), or that no training step could take
(a sample that breaks the rules, a group not whole, past the model's context, records at its positions
that are not the ones it describes, a token id outside the vocabulary, routing that does not unpack), is
dead-lettered; a group the processor did send is dropped as well (reason ``invalid``), so its credit
comes back.

A drop is for good: it is kept in the ledger (streams/ledger.py, the trainer's drops) before its record is
sent. A trainer killed after a stale drop and before its next checkpoint resumes at an older version, re-reads
the group and would train it — while the dead life's drop is on the log. A later life drops such a group
again, as the first decided, and never trains it; so the trainer's lives, the audit and the lineage agree.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import zstandard

from milestream.config import Config, import_path
from milestream.infra.kafka import Delivery, PositionReader, RecordConsumer, RecordProducer, topic_name
from milestream.infra.model import model_config
from milestream.infra.offsets import HeldOffsets
from milestream.schemas import routing, topics
from milestream.schemas.codec import Position, RecordError, decode_values
from milestream.schemas.records import GroupManifest, GroupSample, Record, Trajectory, trajectory_id
from milestream.streams.groups import (MismatchError, drop_record, join_sample, oldest_version, record_positions,
                                       source_topics, staleness)
from milestream.streams.ledger import BufferLedger, TrainerDrop

READ_BATCH = 512  # manifests read before the ledger is asked, once, which of them the processor sent
LIFE = "; trainer pid "  # closes a drop's detail: the life of the trainer that wrote it (``life_of``)


def life_of(detail: str) -> int | None:
    """The pid of the trainer life that wrote a drop with this detail (None: not the trainer's)."""
    _, found, pid = detail.rpartition(LIFE)
    return int(pid) if found and pid.isdigit() else None


@dataclass(frozen=True)
class PooledGroup:
    group_id: str
    manifest: list[GroupManifest]
    position: Position
    arrival: int  # order of arrival in this trainer process
    value: bytes | None = None  # the manifest as it came, for its dead letter
    samples: list[GroupSample] = field(default_factory=list)  # its records joined, once taken

    @property
    def oldest_version(self) -> int:
        oldest = oldest_version(self.manifest)
        return -1 if oldest is None else oldest


Selector = Callable[[Sequence[PooledGroup], int], list[PooledGroup]]


def fifo(pool: Sequence[PooledGroup], count: int) -> list[PooledGroup]:
    """The groups that arrived first."""
    return sorted(pool, key=lambda g: g.arrival)[:count]


def soonest_stale_first(pool: Sequence[PooledGroup], count: int) -> list[PooledGroup]:
    """The groups that pass the staleness bound soonest (oldest token first), then those that arrived first (the
    default): a group is trained before it goes stale whenever a batch can take it, so the only stale drops are
    those no order could have saved. A long-tailed group arrives after groups admitted later; first in first out
    would leave it for a later step, past the bound."""
    return sorted(pool, key=lambda g: (g.oldest_version, g.arrival))[:count]


def freshest_first(pool: Sequence[PooledGroup], count: int) -> list[PooledGroup]:
    """The groups whose oldest token is newest: less off-policy data, older groups wait (and may go stale)."""
    return sorted(pool, key=lambda g: (-g.oldest_version, g.arrival))[:count]


class GroupCollector:
    def __init__(self, cfg: Config, producer: RecordProducer, offsets: dict[int, int], partitions: list[int],
                 seen_groups: set[str], resumed: bool = False):
        self.cfg, self.producer, self.seen_groups = cfg, producer, seen_groups
        self.selector: Selector = import_path(cfg.buffer.selector, "buffer.selector")
        self.ledger = BufferLedger(cfg)
        text_config = model_config(cfg.model).get_text_config()
        self.vocab_size, self.context = text_config.vocab_size, text_config.max_position_embeddings
        self.partitions = len(partitions)
        self.shadow = cfg.trainer.shadow
        group = f"{cfg.broker.topic_prefix}trainer" + (f"-shadow-{cfg.run_path.name}" if self.shadow else "")
        self.consumer = RecordConsumer(cfg.broker, topics.GROUPS, group,
                                       deadletter=None if self.shadow else producer).assign(offsets, partitions)
        self.reader = PositionReader(cfg.broker, f"{group}-records")
        self.topic = {spec: topic_name(cfg.broker, spec) for spec in source_topics(cfg.distill.enabled)}
        self.held = HeldOffsets(resumed=offsets)
        self.pool: dict[str, PooledGroup] = {}
        self.arrivals = 0
        self.dropped_stale = 0
        self.collected_lags: list[int] = []  # of every group taken or dropped stale since the last step's figures
        self.log_read_s = 0.0  # reading and decoding from the log since the last step's figures
        self.costs_counted = self.ledger.log_costs()  # the other stages' log costs, up to the last step's figures
        # by reason, up to the last step's figures: a fresh run counts from its start, a resumed one from now
        self.drops_counted = self._drop_totals() if resumed else {}

    def take(self, count: int, version: int, stopping: Callable[[], bool]) -> list[tuple[PooledGroup, int]] | None:
        """``count`` fresh groups chosen by the selector, their records joined, each with its staleness; None
        once stopping."""
        while not stopping():
            cpu = time.thread_time()  # of the manifests' polls only their decoding is the log's: not the wait
            self._read(timeout=0.0 if len(self.pool) >= count else 1.0)  # enough pooled: what is there, no wait
            self.log_read_s += time.thread_time() - cpu
            self._drop_stale(version)
            if len(self.pool) < count:
                continue
            started = time.perf_counter()
            chosen = self._joined(self.selector(list(self.pool.values()), count))
            self.log_read_s += time.perf_counter() - started
            if len(chosen) < count:  # some were invalid and have left: choose again
                continue
            if self.cfg.admission_lead is not None and not self.shadow:
                self.ledger.raise_floor(version + self.cfg.admission_lead)
            for group in chosen:
                self._leave(group)
            taken = [(g, staleness(g.manifest, version)) for g in chosen]
            self.collected_lags += [lag for _, lag in taken]
            return taken
        return None

    def take_pool_figures(self, version: int) -> dict[str, float]:
        """Groups read but not yet taken, their staleness at ``version``, the stale drops so far, and the
        staleness of every group collected (trained or dropped stale) since the last call."""
        lags = [staleness(g.manifest, version) for g in self.pool.values()]
        collected, self.collected_lags = self.collected_lags, []
        return {"pool_groups": float(len(lags)), "pool_staleness_mean": sum(lags) / len(lags) if lags else 0.0,
                "pool_staleness_max": float(max(lags, default=0)), "stale_dropped_total": float(self.dropped_stale),
                "collected_staleness_mean": sum(collected) / len(collected) if collected else 0.0,
                "collected_staleness_max": float(max(collected, default=0))}

    def take_drop_figures(self) -> dict[str, float]:
        """``dropped_<reason>``: the groups dropped since the last call, by the processor (its run totals in
        the ledger) and here (stale)."""
        totals = self._drop_totals()
        since = {reason: count - self.drops_counted.get(reason, 0) for reason, count in totals.items()}
        self.drops_counted = totals
        return {f"dropped_{reason}": float(count) for reason, count in sorted(since.items())}

    def take_cost_figures(self) -> dict[str, float]:
        """What the log cost since the last call: ``log_read_s`` (this trainer reading its manifests and records,
        decoding and joining them), ``log_write_s`` (the rollout workers encoding and producing their records),
        ``processor_cpu_s`` (the processors' CPU). A total that went down (a lost Redis) counts from zero."""
        totals, before = self.ledger.log_costs(), self.costs_counted

        def since(name: str) -> float:
            total, counted = totals.get(name, 0.0), before.get(name, 0.0)
            return total - counted if total >= counted else total
        read, self.costs_counted, self.log_read_s = self.log_read_s, totals, 0.0
        return {"log_read_s": read, "log_write_s": since("rollout_encode_s"), "processor_cpu_s": since("processor_cpu_s")}

    def _drop_totals(self) -> dict[str, int]:
        totals = {key.removeprefix("dropped_"): count for key, count in self.ledger.run_totals().items()
                  if key.startswith("dropped_")}
        return {**totals, "stale": totals.get("stale", 0) + self.dropped_stale}

    def offsets(self) -> dict[int, int]:
        """Next offsets to read on resume: below the oldest group still pooled."""
        return self.held.committable()

    # ---- manifests in ---------------------------------------------------------------------------------

    def _read(self, timeout: float) -> None:
        deliveries: list[Delivery[GroupManifest]] = self.consumer.poll_many(READ_BATCH, timeout)
        sent, dropped = self.ledger.sent(sorted({d.records[0].group_id for d in deliveries} - self.seen_groups))
        for delivery in deliveries:
            position, rows = delivery.position, delivery.records
            self.held.started(position.partition, position.offset)
            group_id = rows[0].group_id
            if group_id in self.seen_groups or group_id in self.pool:
                self.held.done(position.partition, position.offset)  # re-emitted after a processor restart
                continue
            group = PooledGroup(group_id, rows, position, self.arrivals, delivery.value)
            if group_id in dropped:  # by a life of the trainer that died before its checkpoint saw it
                self._drop(group, dropped[group_id])
                self._leave(group)
                continue
            try:
                check_manifest(rows, self.cfg.rollout.group_size, self.context, self.partitions,
                               self.cfg.distill.enabled)
                if group_id not in sent:
                    raise MismatchError("group_id", f"the processor never sent group {group_id!r}")
            except MismatchError as exc:
                self._refuse(group, exc, sent=group_id in sent, key=delivery.key)
                continue
            self.pool[group_id] = group
            self.arrivals += 1

    def _refuse(self, group: PooledGroup, exc: MismatchError, sent: bool, key: bytes | None = None) -> None:
        """Dead-letter a manifest no step can take; a group the processor sent is dropped too (its credit back)."""
        if sent:
            self._drop(group, TrainerDrop("invalid", -1), f"{exc.field}: {exc}")
            self._leave(group)
        else:
            self.pool.pop(group.group_id, None)
            self.held.done(group.position.partition, group.position.offset)
        if self.shadow:  # the live trainer dead-letters it
            return
        self.producer.dead_letter(group.position, RecordError(group.position, exc.field, str(exc)),
                                  key if key is not None else group.group_id.encode(), group.value)

    def _drop_stale(self, version: int) -> None:
        for group in list(self.pool.values()):
            lag = staleness(group.manifest, version)
            if lag > self.cfg.staleness_bound:
                detail = f"staleness {lag} > {self.cfg.staleness_bound} ({self.cfg.run.schedule} schedule)"
                self._drop(group, TrainerDrop("stale", version), detail)
                self.collected_lags.append(lag)
                self._leave(group)

    def _drop(self, group: PooledGroup, drop: TrainerDrop, detail: str | None = None) -> None:
        """Drop the group for good (see the module docstring): the ledger first, then its record, which names
        this life of the trainer. ``detail`` None: as an earlier life decided. A shadow only counts its stale drops:
        the group's fate is the live trainer's."""
        if self.shadow:
            self.dropped_stale += drop.reason == "stale"
            return
        decided = self.ledger.drop_for_good(group.group_id, drop)
        if detail is None or decided != drop:  # a drop of an earlier life stands
            detail = f"{decided.reason}, as an earlier life of the trainer decided"
        record = drop_record(group.group_id, group.manifest, decided.reason, f"{detail}{LIFE}{os.getpid()}",
                             "trainer", decided.version)
        self.producer.send(topics.DROPPED, [record], key=group.group_id)
        if decided.reason == "stale":
            self.dropped_stale += 1

    def _leave(self, group: PooledGroup) -> None:
        """The group has left this trainer (taken or dropped), and the queue: its credit comes back (once)."""
        self.pool.pop(group.group_id, None)
        self.seen_groups.add(group.group_id)
        self.held.done(group.position.partition, group.position.offset)
        if not self.shadow:
            self.ledger.leave(group.group_id)

    # ---- records in -----------------------------------------------------------------------------------

    def _joined(self, chosen: list[PooledGroup]) -> list[PooledGroup]:
        """The chosen groups with their samples, read in one pass; an invalid one is refused and left out."""
        records = Records(self.reader, self.topic, [row for g in chosen for row in g.manifest])
        out = []
        for group in chosen:
            try:
                samples = [join_sample(row, records.of(row)) for row in group.manifest]
                check_group(samples, self.cfg.rollout.group_size, self.vocab_size, self.context)
            except MismatchError as exc:
                self._refuse(group, exc, sent=True)
                continue
            out.append(replace(group, samples=samples))
        return out

    def close(self) -> None:
        self.consumer.close()
        self.reader.close()


class Records:
    """The records a batch of manifests points at: read in one pass, decoded per topic in one pass.

    The rules of each record (streams/sources.py) are not run again: a manifest the processor sent (the ledger
    says so) names records it took only after they passed them, and a log's records never change; what is
    checked here is that each record is the one its manifest describes (``join_sample``), and then the
    trainer's own limits on the joined group (``check_group``)."""

    def __init__(self, reader: PositionReader, topic: dict[topics.TopicSpec, str], rows: list[GroupManifest]):
        self.topic = topic
        messages = reader.read({at for row in rows for at, _, _ in self.positions(row)})
        self.decoded: dict[tuple[str, int, int], list[Record] | RecordError] = {}
        for spec, name in topic.items():
            ats = sorted(at for at in messages if at[0] == name)
            values = [(messages[at].value, Position(*at)) for at in ats]
            self.decoded.update(zip(ats, decode_values(values, spec.record)))

    def positions(self, row: GroupManifest) -> list[tuple[tuple[str, int, int], int, str]]:
        """((full topic, partition, offset), row in the value, the manifest's field) of each of a row's records;
        MismatchError for a record on a topic this run does not read (a teacher's, distillation off)."""
        out = []
        for spec, offset, index, field_name in record_positions(row):
            if spec not in self.topic:
                raise MismatchError(field_name, f"a record on {spec.name}, which this run does not read")
            out.append(((self.topic[spec], row.partition, offset), index, field_name))
        return out

    def of(self, row: GroupManifest) -> list[Record]:
        """The records at a row's positions; MismatchError naming the field when one is missing or does not decode."""
        return [self._record(at, index, field_name) for at, index, field_name in self.positions(row)]

    def _record(self, at: tuple[str, int, int], index: int, field_name: str) -> Record:
        records = self.decoded.get(at)
        if records is None:
            raise MismatchError(field_name, f"no record read at {at[0]}[{at[1]}]@{at[2]}")
        if isinstance(records, RecordError):
            raise MismatchError(field_name, str(records))
        if not 0 <= index < len(records):
            raise MismatchError(field_name, f"no record {index} in the value at {at[0]}[{at[1]}]@{at[2]}")
        return records[index]

def check_manifest(rows: list[GroupManifest], group_size: int, context: int, partitions: int,
                   needs_teacher: bool = False) -> None:
    """Raise MismatchError naming the field of a manifest no training step can take (``context``: the model's;
    ``needs_teacher``: on-policy distillation is on)."""
    check_leaves(rows, group_size)
    for row in rows:
        if row.group_id != rows[0].group_id or row.trajectory_id != trajectory_id(row.group_id, row.sample_index,
                                                                                  row.leaf):
            raise MismatchError("group_id", f"sample {row.trajectory_id!r} in group {rows[0].group_id!r}")
        if row.group_size != group_size or row.status not in Trajectory.STATUSES:
            raise MismatchError("status", f"group size {row.group_size}, status {row.status!r}")
        if not all(math.isfinite(v) for v in (row.reward, row.submitted_at, row.finished_at)):
            raise MismatchError("reward", f"reward {row.reward}, times {row.submitted_at}, {row.finished_at}")
        if min(row.prompt_tokens, row.response_tokens) < 0 or row.prompt_tokens + row.response_tokens > context:
            raise MismatchError("response_tokens", f"{row.prompt_tokens} + {row.response_tokens} tokens; the model's "
                                f"context is {context}")
        if not -1 <= row.min_version <= row.max_version or (row.min_version < 0) != (row.response_tokens == 0):
            raise MismatchError("min_version", f"versions {row.min_version}..{row.max_version} of "
                                f"{row.response_tokens} tokens")
        if (row.teacher_offset >= 0) != needs_teacher:
            raise MismatchError("teacher_offset", f"sample {row.sample_index}: teacher log-probs at "
                                f"{row.teacher_offset}; distill is {'on' if needs_teacher else 'off'}")
        offsets = [row.trajectory_offset, row.logprobs_offset, *row.routing_offsets]
        rows_at = [row.trajectory_row, row.logprobs_row, *row.routing_rows]
        if needs_teacher:
            offsets, rows_at = offsets + [row.teacher_offset], rows_at + [row.teacher_row]
        if not 0 <= row.partition < partitions or min(offsets + rows_at) < 0 or len(rows_at) != len(offsets):
            raise MismatchError("partition", f"records at partition {row.partition}, offsets {offsets}, rows {rows_at}")


def check_group(samples: list[GroupSample], group_size: int, vocab_size: int, context: int) -> None:
    """Raise MismatchError naming the field of a joined group no training step can take."""
    for sample in samples:
        if sample.group_id != samples[0].group_id:
            raise MismatchError("group_id", f"samples of groups {samples[0].group_id!r} and {sample.group_id!r}")
        if max(max(sample.prompt_ids, default=0), max(sample.response_ids, default=0)) >= vocab_size:
            raise MismatchError("response_ids", f"a token id past the vocabulary ({vocab_size})")
        if len(sample.prompt_ids) + len(sample.response_ids) > context:
            raise MismatchError("response_ids", f"{len(sample.prompt_ids) + len(sample.response_ids)} tokens, past "
                                f"the model's context of {context}")
        if sample.routing_layout or sample.routing_data:
            _check_routing(sample)
    check_leaves(samples, group_size)


def check_leaves(rows: Sequence[GroupManifest | GroupSample], group_size: int) -> None:
    """Samples 0..group_size-1, each as its leaves 0..leaves-1 once: MismatchError otherwise."""
    found = sorted((row.sample_index, row.leaf, row.leaves) for row in rows)
    leaves = {index: count for index, _, count in found}
    expected = sorted((index, leaf, count) for index, count in leaves.items() for leaf in range(count))
    if sorted(leaves) != list(range(group_size)) or found != expected:
        raise MismatchError("sample_index", f"(sample, leaf, leaves) {found} of a group of {group_size}")


def _check_routing(sample: GroupSample) -> None:
    """Every chunk inflates, and together to exactly the layout's bytes; a chunk that declares more than the
    layout holds is refused unread. (Unpacking the ids cannot fail past that: the learner does it once.)"""
    layout = sample.routing_layout
    whole = math.prod(layout) if len(layout) == 4 and min(layout) >= 0 else -1
    try:
        if whole < 0 or sample.routing_compression not in (routing.COMPRESSION, routing.PLAIN_COMPRESSION):
            raise ValueError(f"layout {layout}, compression {sample.routing_compression!r}")
        inflated, decompressor = 0, zstandard.ZstdDecompressor()
        for chunk in sample.routing_data:
            declared = zstandard.frame_content_size(chunk)
            if declared < 0 or inflated + declared > whole:
                raise ValueError(f"a chunk declaring {declared} bytes past the layout {layout}")
            inflated += len(decompressor.decompress(chunk))
        if inflated != whole:
            raise ValueError(f"{inflated} bytes of routing for layout {layout}")
    except (ValueError, zstandard.ZstdError) as exc:
        raise MismatchError("routing_data", f"sample {sample.sample_index}: {exc}") from None
