"""The trainer's side of the buffer against the real broker: selection, stale drops, resume offsets."""
from __future__ import annotations

from milestream.train.collector import GroupCollector, freshest_first
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import GroupSample
from milestream.streams.ledger import EMITTED, BufferLedger


def group(gid: str, version: int, size: int = 4) -> list[GroupSample]:  # the test configuration's group size
    return [GroupSample(f"{gid}/{i}", gid, "p", i, size, [1], [2], [1], [version], 0.0, "completed", "", "e", "w",
                        0.0, 0.0, logprobs=[-0.5]) for i in range(size)]


def publish(cfg, groups: dict[str, int]) -> RecordProducer:
    """Emit the groups as the processor does: on buffer.groups, then settled (queued) in Redis."""
    producer = RecordProducer(cfg.broker)
    ledger = BufferLedger(cfg)
    for gid, version in groups.items():
        producer.send(topics.GROUPS, group(gid, version), key=gid)
        ledger.begin_sending(gid)
    producer.flush()
    for gid, version in groups.items():
        ledger.settle(gid, EMITTED, version)
    return producer


def collector(cfg, producer, offsets=None, seen=None) -> GroupCollector:
    return GroupCollector(cfg, producer, offsets or {}, list(range(cfg.broker.partitions)), seen if seen is not None else set())


def test_fifo_takes_in_arrival_order_and_drops_stale_at_collection(cfg):
    producer = publish(cfg, {"a": 0, "b": 3, "c": 5, "d": 5})
    c = collector(cfg, producer)
    taken = c.take(2, version=5, stopping=lambda: False)  # max_staleness 2: "a" (lag 5) is dropped
    assert len(taken) == 2 and all(lag <= 2 for _, lag in taken)
    assert "a" not in {g.group_id for g, _ in taken} and "a" in c.seen_groups
    assert len(c.pool) == 1
    producer.flush()
    drops = RecordConsumer(cfg.broker, topics.DROPPED, "audit").assign(partitions=range(cfg.broker.partitions))
    (dropped,) = [r for d in drops.drain() for r in d.records]
    assert (dropped.group_id, dropped.reason, dropped.dropped_by) == ("a", "stale", "trainer")
    assert BufferLedger(cfg).available() == cfg.buffer_capacity + 3  # nobody took credit here; 3 groups left
    # the one still pooled waits in the queue (which one depends on how the partitions were read)
    assert BufferLedger(cfg).queued_versions() == [g.oldest_version for g in c.pool.values()]
    c.close()


def test_freshest_first_prefers_newer_groups(cfg):
    cfg = cfg.with_overrides(buffer={"selector": "milestream.train.collector:freshest_first"})
    producer = publish(cfg, {"old": 3, "new": 5, "mid": 4})
    c = collector(cfg, producer)
    assert c.selector is freshest_first
    c._read(timeout=5.0)
    while len(c.pool) < 3:
        c._read(timeout=1.0)
    taken = c.take(2, version=5, stopping=lambda: False)
    assert [g.group_id for g, _ in taken] == ["new", "mid"]
    c.close()


def test_resume_rereads_the_pool_and_skips_what_was_taken(cfg):
    producer = publish(cfg, {f"g{i}": 0 for i in range(6)})
    first = collector(cfg, producer)
    while len(first.pool) < 6:
        first._read(timeout=1.0)
    taken = {g.group_id for g, _ in first.take(3, version=0, stopping=lambda: False)}
    offsets, seen = first.offsets(), set(first.seen_groups)
    first.close()
    resumed = collector(cfg, producer, offsets, seen)
    rest = {g.group_id for g, _ in resumed.take(3, version=0, stopping=lambda: False)}
    assert rest == {f"g{i}" for i in range(6)} - taken
    resumed.close()
