"""A thin layer over confluent-kafka: typed producer, consumer and admin for the topic catalogue.

Values are Arrow IPC (see ``schemas.codec``). A value that does not decode goes to the dead-letter
topic with its position and error; the consumer logs it and carries on. Its clients raise confluent-kafka's
``KafkaException``: callers (tests included) import it from here, never from confluent_kafka.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, Sequence, TypeVar

from confluent_kafka import (OFFSET_BEGINNING, Consumer, ConsumerGroupTopicPartitions, KafkaError, KafkaException,
                             Producer, TopicPartition)
from confluent_kafka.admin import AdminClient, NewTopic

from milestream.config import BrokerConfig
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError, decode, encode, headers_for
from milestream.schemas.records import DeadLetter, Record

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Record)

# tansu's group joins take session.timeout/2; these keep joins near 3 s.
GROUP_TIMEOUTS = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "1000"}


def client_config(cfg: BrokerConfig, **extra: str) -> dict[str, str]:
    if not cfg.bootstrap_servers:
        raise ValueError("broker.bootstrap_servers is not set (start the embedded broker first)")
    return {"bootstrap.servers": cfg.bootstrap_servers, **cfg.client, **extra}


def topic_name(cfg: BrokerConfig, spec: topics.TopicSpec) -> str:
    return cfg.topic_prefix + spec.name


def new_topics(cfg: BrokerConfig, specs: Iterable[topics.TopicSpec] = topics.CATALOGUE) -> list[NewTopic]:
    """How each topic is created: partitions, replication and settings from the configuration."""
    return [
        NewTopic(
            topic_name(cfg, spec),
            num_partitions=cfg.partitions if spec.keyed_partitions else 1,
            replication_factor=cfg.replication_factor,
            config={"max.message.bytes": str(spec.max_message_mb * 1024 * 1024), **cfg.topic_config},
        )
        for spec in specs
    ]


def answers(cfg: BrokerConfig, timeout_s: float = 5.0) -> bool:
    """Whether the broker answers a metadata request within ``timeout_s`` (an open port alone is not a ready
    broker); False at once when no bootstrap server accepts a connection (a finished run's). librdkafka logs
    nothing meanwhile: it would print each refused connection, and here a refusal is the answer."""
    if not any(_accepts(server) for server in client_config(cfg)["bootstrap.servers"].split(",")):
        return False
    try:
        AdminClient(client_config(cfg, log_level="0")).list_topics(timeout=timeout_s)
        return True
    except Exception:  # noqa: BLE001 - any failure means no answer
        return False


def _accepts(server: str, timeout_s: float = 1.0) -> bool:
    """Whether ``[PROTOCOL://]host:port`` accepts a TCP connection."""
    host, _, port = server.strip().rpartition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def broker_answers(bootstrap_servers: str, timeout_s: float = 1.0) -> bool:
    """``answers`` for the embedded broker: plaintext on loopback, whatever the run's client settings say."""
    return answers(BrokerConfig(bootstrap_servers=bootstrap_servers), timeout_s)


class Admin:
    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.client = AdminClient(client_config(cfg))

    def create_topics(self, specs: Iterable[topics.TopicSpec] = topics.CATALOGUE) -> list[str]:
        """Create the missing topics; returns the names created."""
        existing = set(self.list_topics())
        new = [topic for topic in new_topics(self.cfg, specs) if topic.topic not in existing]
        create_new(self.client, new)
        return [t.topic for t in new]

    def list_topics(self) -> dict[str, int]:
        metadata = self.client.list_topics(timeout=10)
        return {name: len(t.partitions) for name, t in metadata.topics.items() if not name.startswith("__")}

    def partitions(self, spec: topics.TopicSpec) -> list[int]:
        name = topic_name(self.cfg, spec)
        metadata = self.client.list_topics(name, timeout=10).topics[name]
        return sorted(metadata.partitions)


class RecordProducer:
    def __init__(self, cfg: BrokerConfig, client_id: str = "milestream"):
        self.cfg = cfg
        self.producer = Producer(client_config(
            cfg, **{"client.id": client_id, "enable.idempotence": "true", "linger.ms": "5",
                    "message.max.bytes": str(cfg.max_message_bytes), "compression.type": "none"}))

    def send(self, spec: topics.TopicSpec, records: Sequence[Record], key: str | None = None) -> None:
        if not all(isinstance(r, spec.record) for r in records):
            raise TypeError(f"{spec.name} carries {spec.record.__name__} records")
        self.send_raw(spec, encode(records), key, headers_for(spec.record))

    def send_raw(self, spec: topics.TopicSpec, value: bytes | None, key: str | bytes | None,
                 headers: list[tuple[str, bytes]] | None = None,
                 delivered: Callable[[Position | KafkaError], None] | None = None) -> None:
        """Any bytes (or none) as the value. ``delivered`` gets where the value landed, or the broker's
        refusal (a value over the topic's max.message.bytes); without it a refusal raises."""
        topic = topic_name(self.cfg, spec)

        def on_delivery(err, msg) -> None:
            if delivered is None:
                _raise_on_error(err, msg)
            else:
                delivered(err if err is not None else Position(msg.topic(), msg.partition(), msg.offset()))

        while True:
            try:
                self.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=on_delivery)
                break
            except BufferError:  # local queue full: let deliveries drain
                self.producer.poll(0.05)
        self.producer.poll(0)

    def dead_letter(self, position: Position, error: RecordError | str, key: bytes | None,
                    value: bytes | None) -> None:
        field = error.field if isinstance(error, RecordError) else ""
        record = DeadLetter(position.topic, position.partition, position.offset, str(error), field,
                            key, value, time.time())
        self.send(topics.DEADLETTER, [record], key=position.topic)
        log.error("dead-lettered %s", error)

    def poll(self, timeout: float = 0.0) -> None:
        """Serve the delivery reports that have come (their callbacks run here)."""
        self.producer.poll(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        if self.producer.flush(timeout) > 0:
            raise TimeoutError(f"{len(self.producer)} messages not delivered after {timeout}s")

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued, then let the client go: its threads stop, rather than retrying a broker that
        may be gone, whenever the object happens to be collected."""
        self.flush(timeout)
        self.producer.close()


def _raise_on_error(err, msg) -> None:
    if err is not None:
        raise KafkaException(err)


@dataclass(frozen=True)
class Delivery(Generic[R]):
    position: Position
    key: bytes | None
    records: list[R]
    ts: float  # broker timestamp, seconds
    value: bytes | None = None  # as it came: what a dead letter of a record found wrong later carries


Check = Callable[[list[R], Position], None]  # raises RecordError naming the field a record got wrong


class RecordConsumer(Generic[R]):
    """Consumes one topic's records; offsets are the caller's to commit or to store.

    ``check``: the reader's own rules for what it takes (a value that decodes can still be hostile); a
    value that breaks one is dead-lettered like one that does not decode."""

    def __init__(self, cfg: BrokerConfig, spec: topics.TopicSpec, group_id: str,
                 deadletter: RecordProducer | None = None, check: Check | None = None, **extra: str):
        self.cfg, self.spec, self.deadletter, self.check = cfg, spec, deadletter, check
        settings = {"group.id": group_id, "enable.auto.commit": "false", "auto.offset.reset": "earliest",
                    "fetch.message.max.bytes": str(cfg.max_message_bytes),
                    "fetch.wait.max.ms": str(cfg.fetch_wait_ms), **GROUP_TIMEOUTS, **extra}
        self.consumer = Consumer(client_config(cfg, **settings))
        self.topic, self.group_id = topic_name(cfg, spec), group_id
        self.subscribed = False
        self.owned: set[int] = set()  # a subscribed member's partitions, as its rebalance callbacks tell
        self.starts: dict[int, int] = {}  # an assigned reader's first offsets

    def subscribe(self) -> "RecordConsumer[R]":
        """Share the topic's partitions with the other members of the group (they rebalance as members come
        and go). Which member holds which partitions is the first question about a group that stalls, so
        each assignment and revocation is logged; confluent-kafka still assigns after the callbacks."""
        self.consumer.subscribe([self.topic], on_assign=self._rebalanced("assigned"),
                                on_revoke=self._rebalanced("revoked"), on_lost=self._rebalanced("lost"))
        self.subscribed = True
        return self

    def _rebalanced(self, event: str) -> Callable[[Consumer, list[TopicPartition]], None]:
        """Keeps ``owned`` (asking librdkafka for the assignment from another thread can block for as long as
        a rebalance lasts) and logs the change."""
        def callback(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            changed = {p.partition for p in partitions}
            self.owned = self.owned | changed if event == "assigned" else self.owned - changed
            log.info("consumer group %s %s %s partitions %s", self.group_id, event, self.topic, sorted(changed))
        return callback

    def assign(self, offsets: dict[int, int] | None = None, partitions: Iterable[int] = ()) -> "RecordConsumer[R]":
        """Read the given partitions from the given next offsets (the beginning where none is given)."""
        offsets = offsets or {}
        wanted = set(partitions) | set(offsets)
        self.starts = {p: offsets.get(p, 0) for p in wanted}  # librdkafka knows no position before a read
        self.consumer.assign([TopicPartition(self.topic, p, offsets.get(p, OFFSET_BEGINNING)) for p in sorted(wanted)])
        return self

    def poll(self, timeout: float = 1.0) -> Delivery[R] | None:
        """The next decodable delivery, or None when nothing arrived within the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.consumer.poll(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if (delivery := self._delivery(msg)) is not None:
                return delivery

    def poll_many(self, limit: int, timeout: float) -> list[Delivery[R]]:
        """Up to ``limit`` decodable deliveries: those waiting, or the first to arrive within ``timeout`` and any
        behind it."""
        return [d for msg in _batch(self.consumer, limit, timeout) if (d := self._delivery(msg)) is not None]

    def _delivery(self, msg) -> Delivery[R] | None:
        """The message's records, or None: an error, or a value it dead-letters."""
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error on %s: %s", self.topic, msg.error())
            return None
        position = Position(msg.topic(), msg.partition(), msg.offset())
        try:
            records = decode(msg.value(), self.spec.record, position)
            if self.check is not None:
                self.check(records, position)
        except RecordError as exc:
            if self.deadletter is None:
                raise
            self.deadletter.dead_letter(position, exc, msg.key(), msg.value())
            return None
        return Delivery(position, msg.key(), records, msg.timestamp()[1] / 1000.0, msg.value())

    def keep_place(self, seconds: float) -> None:
        """Serve the group for ``seconds`` (its rebalances, its heartbeats) without taking a record: a member
        busy elsewhere keeps its place, and a worker joining or leaving never waits for it.

        Every partition paused here is resumed, revoked during the poll or not: librdkafka keeps a partition's
        pause across rebalances, so one revoked while paused would come back to this member paused, and it
        would hold that partition's prompts without ever reading them (the elastic test's stall)."""
        paused = set(self.owned)
        self.consumer.pause([TopicPartition(self.topic, p) for p in paused])
        try:
            msg = self.consumer.poll(seconds)
            if msg is not None and msg.error() is None:  # from a partition assigned during the poll: put it back
                self.consumer.seek(TopicPartition(msg.topic(), msg.partition(), msg.offset()))
        finally:
            self.consumer.resume([TopicPartition(self.topic, p) for p in sorted(paused | self.owned)])

    def ends(self) -> dict[int, int]:
        """The end offset of each assigned partition: as the last fetch answered it (no round trip), else as the
        broker reports it now (on tansu a lower bound, its last batch's start + 1, which still brings the
        whole batch in; and about half a second per partition)."""
        out = {}
        for tp in self.consumer.assignment():
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            out[tp.partition] = high if high >= 0 else end_offset(self, tp.partition)
        return out

    def reached(self, ends: dict[int, int]) -> bool:
        """Whether every partition in ``ends`` has been read up to its offset there."""
        positions = self.consumer.position([TopicPartition(self.topic, p) for p in ends])
        return all(max(tp.offset, self.starts.get(tp.partition, 0)) >= ends[tp.partition] for tp in positions)

    def drain(self, idle_s: float = 2.0, max_wait_s: float = 60.0) -> list[Delivery[R]]:
        """Everything up to the end offsets the broker reports at the call, then until the topic stays quiet for
        ``idle_s``. Quiet alone is no end: a reader that has not fetched yet looks like an empty topic."""
        ends, out = self.ends(), []
        quiet = time.monotonic()
        deadline = quiet + max_wait_s
        while time.monotonic() < deadline:
            delivery = self.poll(min(idle_s, 0.5))
            if delivery is not None:
                out.append(delivery)
                quiet = time.monotonic()
            elif time.monotonic() - quiet >= idle_s and self.reached(ends):
                break
        return out

    def drain_to_end(self, partition: int, max_wait_s: float = 60.0) -> list[Delivery[R]]:
        """Everything one assigned partition holds now: read up to the end offset the broker reports at the
        call, and no further wait."""
        ends, out = {partition: end_offset(self, partition)}, []
        deadline = time.monotonic() + max_wait_s
        while not self.reached(ends) and time.monotonic() < deadline:
            if (delivery := self.poll(0.5)) is not None:
                out.append(delivery)
        return out

    def commit(self, offsets: dict[int, int], wait: bool = True) -> bool:
        """Commit next offsets (partition -> offset). A subscribed member commits only the partitions it owns
        now: a revoked partition is its new owner's to commit. False when the broker refused (a rebalance
        under way); the caller's next commit carries the same offsets. ``wait=False`` sends the commit and
        returns: during a rebalance the broker may hold a waiting commit for many seconds."""
        if self.subscribed:
            owned = self.owned
            offsets = {p: o for p, o in offsets.items() if p in owned}
        if not offsets:
            return True
        try:
            self.consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in offsets.items()],
                                 asynchronous=not wait)
        except KafkaException as exc:
            log.warning("%s: commit of %s refused (%s); the next commit carries it", self.topic, offsets, exc)
            return False
        return True

    def committed(self, partitions: Iterable[int]) -> dict[int, int]:
        """The group's committed next offsets of ``partitions`` (a partition never committed: absent)."""
        wanted = [TopicPartition(self.topic, p) for p in partitions]
        return {tp.partition: tp.offset for tp in self.consumer.committed(wanted, timeout=10) if tp.offset >= 0}

    def close(self) -> None:
        self.consumer.close()


# ---- raw messages: the archive and restore -------------------------------------------------------
# The archive keeps, and restore puts back, messages byte for byte: nothing decoded, every header, the
# broker's timestamp and its type, the partition and the offset.

@dataclass(frozen=True)
class RawMessage:
    topic: str  # the full name, prefix included
    partition: int
    offset: int
    timestamp_ms: int
    timestamp_type: int
    key: bytes | None
    headers: list[tuple[str, bytes | None]] | None  # None and [] differ on the wire
    value: bytes | None


class RawConsumer:
    """Reads assigned partitions as they are, without decoding; commits nothing (its caller keeps positions)."""

    def __init__(self, cfg: BrokerConfig, group_id: str, **extra: str):
        self.brokers_down = False  # the client's last word: no broker reachable (until a message comes again)
        self.consumer = Consumer(client_config(cfg, **{
            "group.id": group_id, "enable.auto.commit": "false", "fetch.message.max.bytes": str(cfg.max_message_bytes),
            "fetch.wait.max.ms": str(cfg.fetch_wait_ms), "error_cb": self._on_error, **extra}))

    def _on_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self.brokers_down = True

    def assign(self, starts: dict[tuple[str, int], int | None]) -> "RawConsumer":
        """Read each (full topic, partition) from its next offset (the beginning where it is None)."""
        self.consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING if start is None else start)
                              for (topic, partition), start in starts.items()])
        return self

    def consume(self, timeout: float, limit: int = 1000) -> list[RawMessage]:
        """Up to ``limit`` messages: those waiting, or the first to arrive within ``timeout`` and any behind it."""
        batch = _raw_batch(self.consumer, limit, timeout)
        self.brokers_down = self.brokers_down and not batch
        return batch

    def close(self) -> None:
        self.consumer.close()


def _batch(consumer: Consumer, limit: int, timeout: float) -> list:
    """What waits in the local queue, up to ``limit``; if nothing does, the first message to come within
    ``timeout`` and what came with it. (``consume`` alone waits for all ``limit`` or the whole timeout.)"""
    waiting = consumer.consume(num_messages=limit, timeout=0)
    if waiting:
        return waiting
    first = consumer.poll(timeout)
    return [] if first is None else [first, *consumer.consume(num_messages=limit - 1, timeout=0)]


def _raw_batch(consumer: Consumer, limit: int, timeout: float) -> list[RawMessage]:
    out = []
    for msg in _batch(consumer, limit, timeout):
        if msg.error():
            if msg.error().code() != KafkaError._PARTITION_EOF:
                log.warning("consumer error: %s", msg.error())
            continue
        ts_type, ts = msg.timestamp()
        out.append(RawMessage(msg.topic(), msg.partition(), msg.offset(), ts, ts_type, msg.key(), msg.headers(),
                              msg.value()))
    return out


Partition = tuple[str, int]  # (full topic name, partition)


class SourceConsumer:
    """A member of a consumer group over several topics, read in batches of raw messages (nothing decoded):
    the stream processor's input, shared by every processor process. Offsets are the caller's to commit.

    The range assignor gives each member the same partition numbers of every topic of equal partition count,
    so the records of one key (a group) on several topics reach one member. ``on_revoke`` gets the (topic,
    partition)s about to go (commit them there). At most ``queue_kbytes`` of fetched messages wait in the local
    queue (librdkafka's default: 64 MB)."""

    def __init__(self, cfg: BrokerConfig, specs: Sequence[topics.TopicSpec], group_id: str,
                 on_revoke: Callable[[list[Partition]], None] = lambda _: None, queue_kbytes: int = 32768):
        self.consumer = Consumer(client_config(cfg, **{
            "group.id": group_id, "enable.auto.commit": "false", "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "range", "fetch.message.max.bytes": str(cfg.max_message_bytes),
            "fetch.wait.max.ms": str(cfg.fetch_wait_ms), "queued.max.messages.kbytes": str(queue_kbytes),
            **GROUP_TIMEOUTS}))
        self.owned: set[Partition] = set()

        def assigned(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            self.owned |= {(p.topic, p.partition) for p in partitions}
            log.info("consumer group %s assigned %s", group_id, sorted(self.owned))

        def revoked(_consumer: Consumer, partitions: list[TopicPartition]) -> None:
            lost = [(p.topic, p.partition) for p in partitions]
            on_revoke(lost)
            self.owned -= set(lost)
            log.info("consumer group %s revoked %s", group_id, sorted(lost))

        self.consumer.subscribe([topic_name(cfg, spec) for spec in specs], on_assign=assigned, on_revoke=revoked,
                                on_lost=revoked)

    def consume(self, limit: int, timeout: float) -> list[RawMessage]:
        """Up to ``limit`` messages: those waiting, or the first to arrive within ``timeout`` and any behind it."""
        return _raw_batch(self.consumer, limit, timeout)

    def commit(self, offsets: dict[Partition, int], wait: bool = False) -> bool:
        """Commit next offsets of the partitions this member owns now; False when the broker refused."""
        owned = {tp: o for tp, o in offsets.items() if tp in self.owned}
        if not owned:
            return True
        try:
            self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in owned.items()], asynchronous=not wait)
        except KafkaException as exc:
            log.warning("commit of %s refused (%s); the next commit carries it", owned, exc)
            return False
        return True

    def close(self) -> None:
        self.consumer.close()


class PositionReader:
    """Reads the messages at given offsets (the trainer reads a group's records where its manifest says they lie).

    A read assigns the partitions it wants at the lowest wanted offset and reads forward, so groups laid out in
    offset order cost one pass; an offset more than ``gap`` ahead is sought (skipping a few small records costs
    less than a seek, one large record does not). Partitions are unassigned after a read (a resumed one can
    wait a second for its next fetch), and the local queue is small: little is fetched past what a read wants.
    Its records are on the log already, so no fetch waits for more, nor backs off once the queue is full."""

    def __init__(self, cfg: BrokerConfig, group_id: str, gap: int = 8, queue_kbytes: int = 8192):
        self.consumer = Consumer(client_config(cfg, **{
            "group.id": group_id, "enable.auto.commit": "false", "fetch.message.max.bytes": str(cfg.max_message_bytes),
            "fetch.wait.max.ms": "1", "queued.max.messages.kbytes": str(queue_kbytes), "fetch.queue.backoff.ms": "1"}))
        self.gap = gap
        self.next: dict[Partition, int] = {}  # per assigned partition: the offset its next message has

    def read(self, wanted: Iterable[tuple[str, int, int]], timeout_s: float = 120.0) -> dict[tuple[str, int, int], RawMessage]:
        """The messages at (full topic, partition, offset) ``wanted``, those found within ``timeout_s``."""
        need: dict[Partition, list[int]] = {}
        for topic, partition, offset in sorted(set(wanted), reverse=True):  # the next wanted offset last
            need.setdefault((topic, partition), []).append(offset)
        self.next = {tp: offsets[-1] for tp, offsets in need.items()}
        found: dict[tuple[str, int, int], RawMessage] = {}
        if not need:
            return found
        self.consumer.incremental_assign([TopicPartition(t, p, o) for (t, p), o in self.next.items()])
        deadline = time.monotonic() + timeout_s
        try:
            while (remaining := sum(len(offsets) for offsets in need.values())) and time.monotonic() < deadline:
                for message in _raw_batch(self.consumer, min(remaining, 256), 0.1):
                    self._take(message, need.get((message.topic, message.partition), []), found)
        finally:
            self.consumer.incremental_unassign([TopicPartition(t, p) for t, p in self.next])
        return found

    def _take(self, message: RawMessage, offsets: list[int], found: dict) -> None:
        tp = (message.topic, message.partition)
        if tp not in self.next:  # of no partition this read assigned
            return
        self.next[tp] = message.offset + 1
        if offsets and offsets[-1] == message.offset:
            found[(*tp, offsets.pop())] = message
        if offsets and not 0 <= offsets[-1] - self.next[tp] <= self.gap:  # far ahead, or passed (a message
            self.consumer.seek(TopicPartition(*tp, offsets[-1]))  # fetched before a seek back): go there
            self.next[tp] = offsets[-1]

    def close(self) -> None:
        self.consumer.close()


def produce_raw(producer: RecordProducer, topic: str, message: RawMessage,
                on_delivery: Callable[[KafkaError | None, int], None]) -> None:
    """``message`` into the same partition of ``topic``: same key, headers, value and (when set) timestamp.

    ``on_delivery`` gets the delivery error (None when delivered) and the offset it landed at.
    """
    extra = {"timestamp": message.timestamp_ms} if message.timestamp_ms and message.timestamp_ms > 0 else {}
    while True:
        try:
            producer.producer.produce(topic, value=message.value, key=message.key, partition=message.partition,
                                      headers=message.headers, **extra,
                                      on_delivery=lambda err, msg: on_delivery(err, msg.offset()))
            break
        except BufferError:  # local queue full: let deliveries drain
            producer.producer.poll(0.05)
    producer.producer.poll(0)


def commit_offsets(cfg: BrokerConfig, group_id: str, offsets: dict[tuple[str, int], int]) -> None:
    """Commit a consumer group's next offsets per (full topic, partition), as one of its members would."""
    consumer = Consumer(client_config(cfg, **{"group.id": group_id, "enable.auto.commit": "false"}))
    try:
        consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()


def end_offset(reader: RecordConsumer, partition: int) -> int:
    """The broker's end offset (high watermark) of one of ``reader``'s partitions; 0 when it has none."""
    _, high = reader.consumer.get_watermark_offsets(TopicPartition(reader.topic, partition), timeout=10)
    return max(high, 0)


def create_new(client: AdminClient, new: list[NewTopic]) -> None:
    """Create ``new``; one that another client created meanwhile is no error."""
    for future in (client.create_topics(new, operation_timeout=30).values() if new else ()):
        try:
            future.result()
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise


class LogAdmin(Admin):
    """What the archive and restore ask of the broker beyond the catalogue: exact topic shapes, group offsets."""

    def create_shaped(self, shapes: dict[str, tuple[int, int]]) -> None:
        """Create the missing topics of ``shapes`` (full name -> partitions, max.message.bytes)."""
        existing = self.list_topics()
        new = [NewTopic(name, num_partitions=partitions, replication_factor=-1,
                        config={"max.message.bytes": str(max_bytes)})
               for name, (partitions, max_bytes) in shapes.items() if name not in existing]
        create_new(self.client, new)

    def consumer_groups(self, prefix: str) -> list[str]:
        listed = self.client.list_consumer_groups(request_timeout=5).result()
        return [g.group_id for g in listed.valid if g.group_id.startswith(prefix)]

    def committed(self, group_id: str) -> dict[tuple[str, int], int]:
        """A consumer group's committed next offsets per (full topic, partition)."""
        future = self.client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group_id)],
                                                         request_timeout=5)[group_id]
        return {(tp.topic, tp.partition): tp.offset for tp in future.result().topic_partitions or []
                if tp.offset >= 0 and tp.error is None}
