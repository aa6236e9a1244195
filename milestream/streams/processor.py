"""The stream processor: a faust-streaming app that turns rollout records into trainable groups.

rollout.trajectories + rollout.logprobs (keyed by group id, so one partition holds a whole group)
  -> buffer.groups   a complete group that passed the arrival rules
  -> buffer.dropped  a group dropped on arrival, with its reason
  -> deadletter      a record that does not decode
  -> buffer.metrics  queue size, credit, drops, rates, every ``buffer.metrics_interval_s``

Acknowledgement is manual: a source record is acknowledged only when its group has left (emitted or
dropped), so faust commits a partition's offset only below its oldest incomplete group, and a
restarted processor rebuilds partial groups by re-reading the log.
"""
from __future__ import annotations

import collections
import logging
import time

import faust

from milestream.config import Config
from milestream.infra.kafka import topic_name
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, encode, headers_for
from milestream.schemas.records import DeadLetter, Dropped, GroupSample, Metrics
from milestream.streams.credit import Credit
from milestream.streams.groups import GroupAssembler, Outcome, load_filter

log = logging.getLogger(__name__)
INCOMPLETE_AFTER_S = 600.0


class Processor:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.app = faust.App(
            f"{cfg.broker.topic_prefix}milestream-processor",
            broker=f"kafka://{cfg.broker.bootstrap_servers}",
            value_serializer="raw", key_serializer="raw",
            web_enabled=False, topic_allow_declare=False, topic_disable_leader=True,
            broker_session_timeout=6, broker_heartbeat_interval=1,
            consumer_auto_offset_reset="earliest",
            stream_wait_empty=False,  # partial groups are rebuilt from the log on restart
            producer_max_request_size=cfg.broker.max_message_bytes,
            consumer_max_fetch_size=cfg.broker.max_message_bytes,
        )
        self.assembler = GroupAssembler(load_filter(cfg.buffer.filter), cfg.buffer.max_staleness)
        self.credit = Credit(cfg)
        self.counts: collections.Counter[str] = collections.Counter()
        self.started = time.monotonic()
        self._topic = {spec.name: self.app.topic(topic_name(cfg.broker, spec))
                       for spec in (topics.GROUPS, topics.DROPPED, topics.METRICS, topics.DEADLETTER)}
        self._wire()

    def _wire(self) -> None:
        sources = [topic_name(self.cfg.broker, spec) for spec in (topics.TRAJECTORIES, topics.LOGPROBS)]
        spec_of = {topic_name(self.cfg.broker, s): s for s in (topics.TRAJECTORIES, topics.LOGPROBS)}
        self.app.agent(self.app.topic(*sources), name="join")(self._join_agent(spec_of))
        versions = self.app.topic(topic_name(self.cfg.broker, topics.WEIGHT_VERSIONS))
        self.app.agent(versions, name="versions")(self._versions_agent)
        self.app.timer(self.cfg.buffer.metrics_interval_s)(self.publish_metrics)
        self.app.timer(10.0)(self.expire_incomplete)

    def _join_agent(self, spec_of):
        async def join(stream) -> None:
            async for event in stream.noack().events():
                message = event.message
                position = Position(message.topic, message.partition, message.offset)
                spec = spec_of[message.topic]
                try:
                    held = False  # whether a still-incomplete group holds this event
                    for record in decode(event.value, spec.record, position):
                        outcome, fresh = self.assembler.add(record, event)
                        self.counts["records_in" if fresh else "duplicates"] += 1
                        held |= fresh and outcome is None
                        if outcome is not None:
                            await self._settle(outcome)
                    if not held:
                        event.ack()
                except (RecordError, ValueError) as exc:
                    error = exc if isinstance(exc, RecordError) else RecordError(position, "group_size", str(exc))
                    await self._dead_letter(position, error, event)
        return join

    async def _versions_agent(self, stream) -> None:
        spec = topics.WEIGHT_VERSIONS
        async for event in stream.events():
            message = event.message
            position = Position(message.topic, message.partition, message.offset)
            try:
                for record in decode(event.value, spec.record, position):
                    self.assembler.latest_version = max(self.assembler.latest_version, record.version)
            except RecordError as exc:
                await self._dead_letter(position, exc, event)

    async def _settle(self, outcome: Outcome) -> None:
        key = outcome.group_id.encode()
        if outcome.dropped is None:
            await self._topic[topics.GROUPS.name].send(
                key=key, value=encode(outcome.samples), headers=headers_for(GroupSample))
            self.credit.enqueued()
            self.counts["groups_out"] += 1
        else:
            await self._topic[topics.DROPPED.name].send(
                key=key, value=encode([outcome.dropped]), headers=headers_for(Dropped))
            self.credit.give_back()
            self.counts[f"dropped_{outcome.dropped.reason}"] += 1
            log.info("dropped group %s: %s (%s)", outcome.group_id, outcome.dropped.reason, outcome.dropped.detail)
        for handle in outcome.handles:
            handle.ack()

    async def _dead_letter(self, position: Position, error: RecordError, event) -> None:
        record = DeadLetter(position.topic, position.partition, position.offset, str(error), error.field,
                            event.key, event.value, time.time())
        await self._topic[topics.DEADLETTER.name].send(
            key=position.topic.encode(), value=encode([record]), headers=headers_for(DeadLetter))
        self.counts["deadletter"] += 1
        log.error("dead-lettered %s", error)
        event.ack()

    async def expire_incomplete(self) -> None:
        for outcome in self.assembler.expire(INCOMPLETE_AFTER_S):
            await self._settle(outcome)

    async def publish_metrics(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        values = {
            "queue_size": float(self.credit.queued()),
            "credit_available": float(self.credit.available()),
            "partial_groups": float(len(self.assembler.partial)),
            "latest_version": float(self.assembler.latest_version),
            "in_records_per_s": self.counts["records_in"] / elapsed,
            "out_groups_per_s": self.counts["groups_out"] / elapsed,
            **{name: float(count) for name, count in self.counts.items()},
        }
        record = Metrics("processor", int(elapsed), time.time(), values)
        await self._topic[topics.METRICS.name].send(key=b"processor", value=encode([record]),
                                                    headers=headers_for(Metrics))


def run_processor(cfg: Config) -> None:
    """Run the processor until SIGTERM / SIGINT (faust's worker handles both)."""
    processor = Processor(cfg)
    processor.credit.initialise()
    worker = faust.Worker(processor.app, loglevel="WARNING", quiet=True)
    worker.execute_from_commandline()
