"""The stream processor: a faust-streaming app that turns rollout records into trainable groups.

rollout.trajectories + rollout.logprobs + rollout.routing (when an engine records MoE routing; all
keyed by group id, so one partition number holds a whole group)
  -> buffer.groups   a complete group that passed the arrival rules
  -> buffer.dropped  a group dropped on arrival (or still incomplete after buffer.incomplete_after_s)
  -> deadletter      a record that is too large (buffer.max_record_bytes), does not decode, has an
                     unknown schema version, breaks a rule of its own (streams/groups.py check_record),
                     belongs to a group no rollout worker admitted, or contradicts its group; a weight
                     version the trainer did not announce (streams/weights/base.py check_version): each
                     with its topic, partition, offset, error and field
  -> buffer.metrics  queue size, credit, drops, rates, every ``buffer.metrics_interval_s``

Restart safety without broker transactions (tansu does not honour them):

- A source event is acknowledged only when every group holding one of its records has left, and a
  group leaves only once its output record is on the broker. The committed offset of a source
  partition is its oldest unacknowledged event (``infra.offsets.HeldOffsets``; faust's own choice can
  pass an unacknowledged offset, see ``ProcessorApp``), so a restarted processor re-reads every record of
  every group that had not left, and rebuilds the partial groups from the log.
- Which groups have left lives in Redis next to the credit (``streams.ledger``). A group's credit and
  queue accounting happen once, in the same atomic step that marks it settled; a re-read record of
  a settled group is a duplicate. A group the killed process had sent but not yet marked is sent
  again (counted as ``groups_resent``); consumers de-duplicate ``buffer.groups`` by group id.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from typing import Any

import faust

from milestream.config import Config
from milestream.infra.kafka import topic_name
from milestream.infra.offsets import HeldOffsets
from milestream.infra.security import faust_credentials
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, encode, headers_for
from milestream.schemas.records import DeadLetter, Dropped, GroupSample, Metrics
from milestream.streams.groups import (GroupAssembler, MismatchError, Outcome, SourceRecord, check_record, load_filter,
                                       oldest_version, source_topics)
from milestream.streams.ledger import EMITTED, SENDING, SETTLED, BufferLedger
from milestream.streams.versions import check_version

log = logging.getLogger(__name__)

class HeldEvent:
    """A source event and who still needs it: the join agent while it reads the event, and every group
    holding one of its records. It is acknowledged, and its offset released, when the last lets go."""

    __slots__ = ("event", "offsets", "holders")

    def __init__(self, event, offsets: HeldOffsets):
        self.event, self.offsets, self.holders = event, offsets, 1
        offsets.started(event.message.tp, event.message.offset)

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.event.ack()
            self.offsets.done(self.event.message.tp, self.event.message.offset)


class ProcessorApp(faust.App):
    """faust.App whose consumer commits a source partition only up to its oldest unacknowledged event.

    faust (0.15.3) commits the first run of consecutive acknowledged offsets, and checks for an older
    unacknowledged offset neither before a partition's first commit nor, after it, for the offset
    right at the committed position. Groups acknowledge out of order, so that would commit past a
    partial group's early records and lose the group on restart (tests/streams/test_processor_restart).
    """

    source_topics: frozenset[str] = frozenset()  # the join agent's topics: committed at source_offsets
    source_offsets: HeldOffsets | None = None
    fetch_wait_ms: int = 50

    def _new_consumer(self):
        consumer = super()._new_consumer()
        faust_choice = consumer._new_offset  # kept for the topics the join agent does not read

        def commit_point(tp):
            if self.source_offsets is None or tp.topic not in self.source_topics:
                return faust_choice(tp)
            point = self.source_offsets.commit_point(tp)
            _forget_acked_below(consumer, tp, point)
            return point

        consumer._new_offset = commit_point
        self._shorten_fetch_wait(consumer._thread)
        return consumer

    def _shorten_fetch_wait(self, thread) -> None:
        """faust fixes aiokafka's fetch wait at 1500 ms; tansu holds an empty fetch for a share of it even
        when data arrives, which would add ~0.7 s to every hand-off (real Kafka answers at once)."""
        create = thread._create_worker_consumer

        def create_with_short_wait(transport):
            client = create(transport)
            client._fetch_max_wait_ms = self.fetch_wait_ms
            return client

        thread._create_worker_consumer = create_with_short_wait


def _forget_acked_below(consumer, tp, point: int | None) -> None:
    """faust keeps every acknowledged offset until its own commit logic removes it; do that here."""
    acked = consumer._acked[tp]
    if point is None or not acked:
        return
    consumer._acked_index[tp].difference_update(o for o in acked if o < point)
    acked[:] = [o for o in acked if o >= point]


def app_id(cfg: Config) -> str:
    """The processor's faust app id, which is also its consumer group id."""
    return f"{cfg.broker.topic_prefix}milestream-processor"


def faust_settings(cfg: Config) -> dict[str, Any]:
    """The processor's faust settings (benchmarks/processor.py runs its plain forward on the same)."""
    return dict(
        broker=f"kafka://{cfg.broker.bootstrap_servers}",
        broker_credentials=faust_credentials(cfg.broker.client),  # broker.client's SASL/SSL settings
        value_serializer="raw", key_serializer="raw",
        web_enabled=False, topic_allow_declare=False, topic_disable_leader=True,
        broker_session_timeout=6, broker_heartbeat_interval=1,
        broker_commit_interval=cfg.buffer.commit_interval_s,
        consumer_auto_offset_reset="earliest",
        stream_wait_empty=False,  # partial groups are rebuilt from the log on restart
        producer_max_request_size=cfg.broker.max_message_bytes,
        consumer_max_fetch_size=cfg.broker.max_message_bytes,
    )


class Processor:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sources = {topic_name(cfg.broker, spec): spec for spec in source_topics(cfg.distill.enabled)}
        self.offsets: HeldOffsets = HeldOffsets()
        self.app = ProcessorApp(app_id(cfg), **faust_settings(cfg))
        self.app.fetch_wait_ms = cfg.broker.fetch_wait_ms
        self.app.source_topics, self.app.source_offsets = frozenset(self.sources), self.offsets
        self.assembler = GroupAssembler(load_filter(cfg.buffer.filter), cfg.staleness_bound, cfg.distill.enabled)
        self.ledger = BufferLedger(cfg)
        self.counts: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        self._topic = {spec.name: self.app.topic(topic_name(cfg.broker, spec))
                       for spec in (topics.GROUPS, topics.DROPPED, topics.METRICS, topics.DEADLETTER)}
        self._wire()

    def _wire(self) -> None:
        self.app.agent(self.app.topic(*self.sources), name="join")(self._join_agent)
        versions = self.app.topic(topic_name(self.cfg.broker, topics.WEIGHT_VERSIONS))
        self.app.agent(versions, name="versions")(self._versions_agent)
        self.app.timer(self.cfg.buffer.metrics_interval_s)(self.publish_metrics)
        # look a few times per window, so a group leaves within about 1.25 windows of its first record
        self.app.timer(min(10.0, max(0.05, self.cfg.buffer.incomplete_after_s / 4)))(self.expire_incomplete)

    async def _join_agent(self, stream) -> None:
        async for event in stream.noack().events():
            await self._take(event)

    async def _take(self, event) -> None:
        """Admit every record of one source event; a bad event goes to the dead-letter topic."""
        message = event.message
        position = Position(message.topic, message.partition, message.offset)
        held = HeldEvent(event, self.offsets)
        try:
            size, limit = len(event.value or b""), self.cfg.buffer.max_record_bytes
            if size > limit:  # before decoding: a huge value must not cost the memory to decode it
                raise RecordError(position, "<value>", f"{size} bytes, over buffer.max_record_bytes ({limit})")
            records = decode(event.value, self.sources[message.topic].record, position)
            for record in records:  # every record checked before any joins a group
                self._check(record, position)
            for record in records:
                await self._admit(record, held, position)
        except RecordError as exc:
            await self._dead_letter(position, exc, event)
        # not in a finally: an unexpected error leaves the event unacknowledged, to be re-read
        held.release()

    def _check(self, record: SourceRecord, position: Position) -> None:
        try:
            check_record(record, self.cfg.rollout.group_size)
        except MismatchError as exc:
            raise RecordError(position, exc.field, str(exc)) from None

    async def _admit(self, record: SourceRecord, held: HeldEvent, position: Position) -> None:
        try:
            if not self.assembler.knows(record.group_id):
                self._recall(record.group_id)
            outcome, fresh = self.assembler.add(record, held)
        except MismatchError as exc:
            raise RecordError(position, exc.field, str(exc)) from None
        self.counts["records_in" if fresh else "duplicates"] += 1
        if fresh:
            held.hold()  # the group holds the event until the group leaves
        if outcome is not None:
            await self._settle(outcome)

    def _recall(self, group_id: str) -> None:
        """A group first seen in this life may have left in an earlier one: its records are re-reads. A group
        neither admitted by a rollout worker nor sent by the processor is no group of this run: its records
        would hold source offsets and, dropped as incomplete, give back a credit nobody took."""
        settlement = self.ledger.settlement(group_id)
        if settlement == SETTLED:
            self.assembler.mark_finished(group_id)
            self.counts["groups_settled_before_restart"] += 1
        elif settlement is None and not self.ledger.is_admitted(group_id):
            raise MismatchError("group_id", f"no rollout worker admitted group {group_id!r}")

    async def _versions_agent(self, stream) -> None:
        spec = topics.WEIGHT_VERSIONS
        async for event in stream.events():
            message = event.message
            position = Position(message.topic, message.partition, message.offset)
            try:
                records = decode(event.value, spec.record, position)
                bound = self.ledger.trainer_version()
                for record in records:
                    check_version(self.cfg, record, position, bound)
                newest = max(record.version for record in records)
            except RecordError as exc:
                await self._dead_letter(position, exc, event)
                continue
            if newest > self.assembler.latest_version:
                self.assembler.latest_version = newest
                await self.publish_metrics()  # once per trainer step, besides the timer

    async def _settle(self, outcome: Outcome) -> None:
        """Send the group (or its drop record); it is settled and its sources let go once delivered."""
        if self.ledger.begin_sending(outcome.group_id) == SENDING:
            self.counts["groups_resent"] += 1  # an earlier life may have sent it: a possible duplicate
        key = outcome.group_id.encode()
        if outcome.dropped is None:
            delivery = await self._topic[topics.GROUPS.name].send(
                key=key, value=encode(outcome.samples), headers=headers_for(GroupSample))
        else:
            delivery = await self._topic[topics.DROPPED.name].send(
                key=key, value=encode([outcome.dropped]), headers=headers_for(Dropped))
            log.info("dropped group %s: %s (%s)", outcome.group_id, outcome.dropped.reason, outcome.dropped.detail)
        delivery.add_done_callback(functools.partial(self._delivered, outcome))

    def _delivered(self, outcome: Outcome, delivery: asyncio.Future) -> None:
        if delivery.cancelled() or delivery.exception() is not None:
            # the sources stay unacknowledged, so they stay uncommitted and a restart redoes the group
            self.counts["send_errors"] += 1
            log.error("group %s was not delivered: %s", outcome.group_id,
                      "cancelled" if delivery.cancelled() else delivery.exception())
            return
        reason = EMITTED if outcome.dropped is None else outcome.dropped.reason
        oldest = oldest_version(outcome.samples)
        if self.ledger.settle(outcome.group_id, reason, -1 if oldest is None else oldest):
            self.counts["groups_out" if outcome.dropped is None else f"dropped_{reason}"] += 1
        else:
            self.counts["groups_settled_twice"] += 1
        for handle in outcome.handles:
            handle.release()

    async def _dead_letter(self, position: Position, error: RecordError, event) -> None:
        record = DeadLetter(position.topic, position.partition, position.offset, str(error), error.field,
                            event.key, event.value, time.time())
        # no need to wait for delivery before the source is acknowledged: faust flushes its producer
        # before it commits
        await self._topic[topics.DEADLETTER.name].send(
            key=position.topic.encode(), value=encode([record]), headers=headers_for(DeadLetter))
        self.counts["deadletter"] += 1
        log.error("dead-lettered %s", error)

    async def expire_incomplete(self) -> None:
        for outcome in self.assembler.expire(self.cfg.buffer.incomplete_after_s):
            await self._settle(outcome)

    async def publish_metrics(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        values = {
            **self.ledger.figures(self.assembler.latest_version),
            "partial_groups": float(len(self.assembler.partial)),
            "held_source_records": float(self.offsets.held()),
            "latest_version": float(self.assembler.latest_version),
            "uptime_s": elapsed,
            "in_records_per_s": self.counts["records_in"] / elapsed,
            "out_groups_per_s": self.counts["groups_out"] / elapsed,
            **{name: float(count) for name, count in self.counts.items()},
            # the same counts over the whole run, across processor restarts
            **{f"run_{name}": float(count) for name, count in self.ledger.run_totals().items()},
        }
        record = Metrics("processor", self.assembler.latest_version, time.time(), values)
        await self._topic[topics.METRICS.name].send(key=b"processor", value=encode([record]),
                                                    headers=headers_for(Metrics))


def run_processor(cfg: Config) -> None:
    """Run the processor until SIGTERM / SIGINT (faust's worker handles both)."""
    processor = Processor(cfg)
    processor.ledger.initialise()
    worker = faust.Worker(processor.app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()
