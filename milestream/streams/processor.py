"""The stream processor: rollout records in, group manifests out; any number of processes share the work.

rollout.trajectories + rollout.logprobs + rollout.routing (when an engine records MoE routing; all
keyed by group id, so one partition number holds a whole group)
  -> buffer.groups   the manifest of a complete group that passed the arrival rules: per sample the
                     fields the rules need and where its records lie (the trainer reads them there)
  -> buffer.dropped  a group dropped on arrival (or still incomplete after buffer.incomplete_after_s)
  -> deadletter      a record that is too large (buffer.max_record_bytes), does not decode, has an
                     unknown schema version, breaks a rule of its own (streams/sources.py), belongs to a
                     group no rollout worker admitted, or contradicts its group; a weight version the
                     trainer did not announce (streams/versions.py check_version): each with its topic,
                     partition, offset, error and field
  -> buffer.metrics  queue size, credit, drops, rates, every ``buffer.metrics_interval_s``

Throughput: records are taken in batches of raw messages (librdkafka's fetching runs in its own threads,
``consume(num_messages)``); of each value only the small columns become Python objects and the lists are
checked in bulk (streams/sources.py); payload bytes are never copied, re-encoded or sent again. The ledger
is asked once per batch (a pipeline per question: which new groups are settled or admitted, which groups
begin sending, which settle), never once per record. Scale-out: the processes form one consumer group;
the range assignor gives each the same partition numbers of the three topics, so a group is assembled
where all its records arrive. weights.versions goes to one member, which validates it; every member
also follows the trainer's version in the ledger for the stale pre-drop.

Restart safety without broker transactions:

- A source message is let go only when every group holding one of its records has left (its manifest or
  drop delivered and settled) or, for a bad record, once its dead letter is delivered. The committed
  offset of a source partition is its oldest held message (``infra.offsets.HeldOffsets``), so a restarted
  processor, or the member that takes a partition over, re-reads every record of every group that had not
  left and rebuilds the partial groups from the log.
- Which groups have left lives in Redis next to the credit (``streams.ledger``). A group's credit and queue
  accounting happen once, in the same atomic step that marks it settled; a re-read record of a settled
  group is a duplicate. A group a killed process had sent but not yet marked is sent again (counted as
  ``groups_resent``), as that life decided (emitted, or dropped for its reason: the ledger keeps the outcome
  chosen first), so a group is never both on ``buffer.groups`` and on ``buffer.dropped``; the trainer
  de-duplicates ``buffer.groups`` by group id.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from milestream.config import Config
from milestream.infra import faults
from milestream.infra.kafka import KafkaError, Partition, RawMessage, RecordProducer, SourceConsumer, topic_name
from milestream.infra.lifecycle import stop_on_signals
from milestream.infra.offsets import Checkpoint, HeldOffsets
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, encode, headers_for
from milestream.schemas.records import DeadLetter, Metrics
from milestream.streams.groups import GroupAssembler, Outcome, load_filter, oldest_version, source_topics
from milestream.streams.ledger import EMITTED, SENDING, SETTLED, BufferLedger
from milestream.streams.sources import MismatchError, SourceRef, read_values
from milestream.streams.versions import check_version

log = logging.getLogger(__name__)
BATCH = 500  # messages taken at once; a batch costs one ledger round trip per question


class Held:
    """A source message and who still needs it: the processor while it reads the message, every group holding
    one of its records, and its dead letter until delivered. Its offset is let go when the last lets go."""

    __slots__ = ("offsets", "partition", "offset", "holders")

    def __init__(self, offsets: HeldOffsets, partition: int, offset: int):
        self.offsets, self.partition, self.offset, self.holders = offsets, partition, offset, 1
        offsets.started(partition, offset)

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.offsets.done(self.partition, self.offset)


@dataclass
class Taken:
    """One source message of a batch: where it lies, what it holds, its refs (or why it was refused)."""

    message: RawMessage
    held: Held
    refs: list[SourceRef] = field(default_factory=list)
    error: RecordError | None = None

    @property
    def position(self) -> Position:
        return Position(self.message.topic, self.message.partition, self.message.offset)


def app_id(cfg: Config) -> str:
    """The processor's consumer group id."""
    return f"{cfg.broker.topic_prefix}milestream-processor"


class Processor:
    def __init__(self, cfg: Config, stop: threading.Event | None = None):
        self.cfg = cfg
        self.sources = {topic_name(cfg.broker, spec): spec for spec in source_topics(cfg.distill.enabled)}
        self.versions_topic = topic_name(cfg.broker, topics.WEIGHT_VERSIONS)
        self.held: dict[Partition, HeldOffsets[int]] = {}  # per owned partition; a revoked one is forgotten
        self.assembler = GroupAssembler(load_filter(cfg.buffer.filter), cfg.staleness_bound, cfg.distill.enabled)
        self.ledger = BufferLedger(cfg)
        self.assembler.latest_version = self.ledger.trainer_version() or 0  # the pre-drop's rule from the first batch
        self.producer = RecordProducer(cfg.broker, client_id="processor")
        self.consumer = SourceConsumer(cfg.broker, [*self.sources.values(), topics.WEIGHT_VERSIONS], app_id(cfg),
                                       on_revoke=self._revoked)
        self.counts: collections.Counter[str] = collections.Counter()
        self.delivered: list[tuple[Outcome, Position | KafkaError]] = []
        self.started = time.monotonic()
        self.cpu_counted = time.process_time()  # up to what the ledger's log costs hold of this process's CPU
        self.stop = stop or threading.Event()  # infra/lifecycle.py
        expire_every = min(10.0, max(0.05, cfg.buffer.incomplete_after_s / 4))  # a group leaves within ~1.25 windows
        self.timers = {self._commit: cfg.buffer.commit_interval_s, self.publish_metrics: cfg.buffer.metrics_interval_s,
                       self._expire: expire_every, self._follow_trainer: 0.5}
        self.due = dict.fromkeys(self.timers, 0.0)
        self.checkpoint = Checkpoint(self.producer, self.consumer, self._commit_points)

    def run(self) -> None:
        """Until ``stopping``; then what is in flight is delivered and settled, and the offsets committed."""
        while not self.stop.is_set():
            self.step(self.consumer.consume(BATCH, 0.05))
        self.checkpoint.commit(save=self._settle_delivered)
        self.consumer.close()

    def step(self, messages: list[RawMessage]) -> None:
        sources = [m for m in messages if m.topic in self.sources]
        if sources:
            self._send(self._take(sources))
        for message in messages:
            if message.topic == self.versions_topic:
                self._version(message)
        self.producer.poll()  # delivery reports: into self.delivered
        self._settle_delivered()
        now = time.monotonic()
        for timer, every in self.timers.items():
            if now >= self.due[timer]:
                self.due[timer] = now + every
                timer()

    # ---- taking records ------------------------------------------------------------------------------

    def _take(self, messages: list[RawMessage]) -> list[Outcome]:
        """Every record of a batch of source messages admitted, or its message dead-lettered; the groups done."""
        taken = [self._held(m) for m in messages]
        for spec in self.sources.values():
            batch = [t for t in taken if self.sources[t.message.topic] is spec and t.error is None]
            read = read_values([(t.message.value, t.position) for t in batch], spec.record, self.cfg.rollout.group_size)
            for t, refs in zip(batch, read):
                if isinstance(refs, RecordError):
                    t.error = refs
                else:
                    t.refs = refs
        unadmitted = self._recall({ref.group_id for t in taken for ref in t.refs
                                   if not self.assembler.knows(ref.group_id)})
        outcomes = []
        for t in taken:
            try:
                outcomes += self._admit(t, unadmitted)
            except MismatchError as exc:
                t.error = RecordError(t.position, exc.field, str(exc))
            if t.error is not None:
                self._dead_letter(t)
            t.held.release()
        faults.hold("processor.took")
        return outcomes

    def _held(self, message: RawMessage) -> Taken:
        """The message held from now on; refused unread when it is over ``buffer.max_record_bytes`` (a huge value
        must not cost the memory to decode it)."""
        offsets = self.held.setdefault((message.topic, message.partition), HeldOffsets())
        taken = Taken(message, Held(offsets, message.partition, message.offset))
        size, limit = len(message.value or b""), self.cfg.buffer.max_record_bytes
        if size > limit:
            taken.error = RecordError(taken.position, "<value>", f"{size} bytes, over buffer.max_record_bytes ({limit})")
        return taken

    def _recall(self, group_ids: set[str]) -> set[str]:
        """Groups first seen in this life may have left in an earlier one (their records are re-reads); returns
        those neither admitted by a rollout worker nor sent by the processor: no group of this run (their records
        would hold source offsets and, dropped as incomplete, give back a credit nobody took)."""
        unadmitted = set()
        for group_id, (settlement, admitted) in self.ledger.recall(sorted(group_ids)).items():
            if settlement == SETTLED:
                self.assembler.mark_finished(group_id)
                self.counts["groups_settled_before_restart"] += 1
            elif settlement is None and not admitted:
                unadmitted.add(group_id)
        return unadmitted

    def _admit(self, taken: Taken, unadmitted: set[str]) -> list[Outcome]:
        outcomes = []
        for ref in taken.refs:
            if ref.group_id in unadmitted:
                raise MismatchError("group_id", f"no rollout worker admitted group {ref.group_id!r}")
            outcome, fresh = self.assembler.add(ref, taken.held)
            self.counts["records_in" if fresh else "duplicates"] += 1
            if fresh:
                taken.held.hold()  # the group holds the message until the group leaves
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes

    def _dead_letter(self, taken: Taken) -> None:
        """The message's dead letter; the message is held until the letter is on the broker."""
        error, message = taken.error, taken.message
        record = DeadLetter(message.topic, message.partition, message.offset, str(error), error.field, message.key,
                            message.value, time.time())
        taken.held.hold()
        self.producer.send_raw(topics.DEADLETTER, encode([record]), message.topic.encode(), headers_for(DeadLetter),
                               delivered=lambda where, held=taken.held: self._letter_delivered(where, held))
        self.counts["deadletter"] += 1
        log.error("dead-lettered %s", error)

    def _letter_delivered(self, where: Position | KafkaError, held: Held) -> None:
        if isinstance(where, KafkaError):  # held: uncommitted, the record is read and dead-lettered again
            self.counts["send_errors"] += 1
            log.error("a dead letter was not delivered: %s", where)
            return
        held.release()

    def _version(self, message: RawMessage) -> None:
        taken = Taken(message, Held(self.held.setdefault((message.topic, message.partition), HeldOffsets()),
                                    message.partition, message.offset))
        try:
            records = decode(message.value, topics.WEIGHT_VERSIONS.record, taken.position)
            bound = self.ledger.trainer_version()
            for record in records:
                check_version(self.cfg, record, taken.position, bound)
        except RecordError as exc:
            taken.error = exc
            self._dead_letter(taken)
            taken.held.release()
            return
        taken.held.release()
        self._new_version(max(record.version for record in records))

    def _follow_trainer(self) -> None:
        """The trainer's newest version from the ledger: what a member without weights.versions goes by; and
        this process's CPU since the last call, to the ledger's log costs (the trainer's step figures)."""
        self._new_version(self.ledger.trainer_version() or 0)
        cpu = time.process_time()
        self.ledger.add_log_costs({"processor_cpu_s": cpu - self.cpu_counted})
        self.cpu_counted = cpu

    def _new_version(self, version: int) -> None:
        if version > self.assembler.latest_version:
            self.assembler.latest_version = version
            self.publish_metrics()  # once per trainer step, besides the timer

    # ---- groups leaving ------------------------------------------------------------------------------

    def _send(self, outcomes: list[Outcome]) -> None:
        """Send each group's manifest (or its drop record); it is settled, and its sources let go, once delivered."""
        if not outcomes:
            return
        decisions = [(o.group_id, o.drop_reason or EMITTED) for o in outcomes]
        for outcome, begun in zip(outcomes, self.ledger.begin_sending_many(decisions)):
            if begun.before == SETTLED:  # settled by the member that held its partition before: a duplicate
                self.counts["groups_settled_before_restart"] += 1
                self._release(outcome)
                continue
            if begun.before == SENDING:  # an earlier life may have sent it: sent again as that life decided
                self.counts["groups_resent"] += 1
                if begun.decided is not None:  # (a ledger written before outcomes were kept has none)
                    decided = None if begun.decided == EMITTED else begun.decided
                    outcome = outcome.as_decided(decided, self.assembler.latest_version)
            spec, records = (topics.GROUPS, outcome.manifest) if outcome.dropped is None else (topics.DROPPED,
                                                                                              [outcome.dropped])
            if outcome.dropped is not None:
                log.info("dropped group %s: %s (%s)", outcome.group_id, outcome.dropped.reason, outcome.dropped.detail)
            self.producer.send_raw(spec, encode(records), outcome.group_id, headers_for(spec.record),
                                   delivered=lambda where, o=outcome: self.delivered.append((o, where)))

    def _settle_delivered(self) -> None:
        delivered, self.delivered = self.delivered, []
        sent = []
        for outcome, where in delivered:
            if isinstance(where, KafkaError):
                # the sources stay held, so they stay uncommitted and a restart redoes the group
                self.counts["send_errors"] += 1
                log.error("group %s was not delivered: %s", outcome.group_id, where)
            else:
                sent.append(outcome)
        if not sent:
            return
        faults.hold("processor.delivered")
        settlements = [(o.group_id, EMITTED if o.dropped is None else o.dropped.reason, _oldest(o)) for o in sent]
        for outcome, first in zip(sent, self.ledger.settle_many(settlements)):
            if first:
                self.counts["groups_out" if outcome.dropped is None else f"dropped_{outcome.dropped.reason}"] += 1
            else:
                self.counts["groups_settled_twice"] += 1
            self._release(outcome)

    @staticmethod
    def _release(outcome: Outcome) -> None:
        for handle in outcome.handles:
            handle.release()

    def _expire(self) -> None:
        """Drop the groups incomplete for too long, but for one an earlier life emitted: it had every record, so
        they are on the log, coming; its manifest may be on the log as well, so it must not be dropped."""
        overdue = self.assembler.overdue(self.cfg.buffer.incomplete_after_s)
        if overdue:
            decided = self.ledger.decided(overdue)
            self._send(self.assembler.expire(g for g in overdue if decided.get(g) != EMITTED))

    # ---- offsets, partitions, figures ----------------------------------------------------------------

    def _commit_points(self) -> dict[Partition, int]:
        return {tp: point for tp, offsets in self.held.items() if (point := offsets.commit_point(tp[1])) is not None}

    def _commit(self) -> None:
        """Between checkpoints: an offset is held until its groups settled, so none passes an unflushed record."""
        self.consumer.commit(self._commit_points(), wait=False)

    def _revoked(self, partitions: list[Partition]) -> None:
        """Partitions going to another member: commit them, and forget their partial groups (it re-reads them)."""
        self.checkpoint.commit(save=self._settle_delivered)
        numbers = {p for t, p in partitions if t in self.sources}
        self.counts["groups_handed_over"] += len(self.assembler.forget(numbers))
        for tp in partitions:
            self.held.pop(tp, None)

    def publish_metrics(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        values = {
            **self.ledger.figures(self.assembler.latest_version),
            "partial_groups": float(len(self.assembler.partial)),
            "held_source_records": float(sum(offsets.held() for offsets in self.held.values())),
            "latest_version": float(self.assembler.latest_version),
            "uptime_s": elapsed,
            # processors share the work: each sends its own figures, these say whose and of which partitions
            "member_pid": float(os.getpid()),
            "owned_partitions": float(len(self.consumer.owned)),
            "in_records_per_s": self.counts["records_in"] / elapsed,
            "out_groups_per_s": self.counts["groups_out"] / elapsed,
            **{name: float(count) for name, count in self.counts.items()},
            # the same counts over the whole run, across processor restarts and members
            **{f"run_{name}": float(count) for name, count in self.ledger.run_totals().items()},
        }
        record = Metrics("processor", self.assembler.latest_version, time.time(), values)
        self.producer.send(topics.METRICS, [record], key="processor")


def _oldest(outcome: Outcome) -> int:
    if outcome.dropped is not None:
        return outcome.dropped.min_version
    oldest = oldest_version(outcome.manifest)
    return -1 if oldest is None else oldest


def run_processor(cfg: Config) -> None:
    """Run the processor until SIGTERM / SIGINT."""
    stop = stop_on_signals()
    processor = Processor(cfg, stop)
    processor.ledger.initialise()
    processor.run()

