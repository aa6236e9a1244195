"""The trainer's side of the buffer against the real broker: selection, stale drops, resume offsets, and the
records of the groups taken read where their manifests say."""
from __future__ import annotations

import dataclasses

from emitted import emit, simple_group

from milestream.train.collector import GroupCollector, freshest_first
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger


def publish(cfg, groups: dict[str, int]) -> RecordProducer:
    """Emit the groups as the processor does: records on the rollout topics, manifests on buffer.groups, then
    settled (queued) in Redis; the test configuration's group size."""
    producer = RecordProducer(cfg.broker)
    emit(cfg, producer, [r for gid, version in groups.items() for r in simple_group(gid, version, 4)])
    return producer


def collector(cfg, producer, offsets=None, seen=None) -> GroupCollector:
    return GroupCollector(cfg, producer, offsets or {}, list(range(cfg.broker.partitions)), seen if seen is not None else set())


def test_fifo_takes_in_arrival_order_and_drops_stale_at_collection(cfg):
    producer = publish(cfg, {"a": 0, "b": 3, "c": 5, "d": 5})
    c = collector(cfg, producer)
    while len(c.pool) < 4:  # all four read first: take returns once two fresh ones are in, read or not
        c._read(timeout=1.0)
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


def test_a_taken_group_carries_the_records_its_manifest_points_at(cfg):
    producer = publish(cfg, {"a": 1, "b": 2})
    c = collector(cfg, producer)
    taken = {g.group_id: g for g, _ in c.take(2, version=2, stopping=lambda: False)}
    for gid, version in (("a", 1), ("b", 2)):
        samples = taken[gid].samples
        assert [(s.sample_index, s.token_versions, s.logprobs) for s in samples] == \
            [(i, [version], [-0.5]) for i in range(4)]
    c.close()


def test_a_manifest_pointing_at_other_records_is_dropped_invalid_and_dead_lettered(cfg):
    producer = RecordProducer(cfg.broker)
    manifests = emit(cfg, producer, simple_group("good", 0, 4) + simple_group("forged", 0, 4))
    forged = manifests["forged"]
    # the processor sends this manifest again, but its first sample points at the good group's records
    wrong = [dataclasses.replace(forged[0], trajectory_offset=manifests["good"][0].trajectory_offset,
                                 partition=manifests["good"][0].partition,
                                 logprobs_offset=manifests["good"][0].logprobs_offset)] + forged[1:]
    c = collector(cfg, producer)
    while len(c.pool) < 2:
        c._read(timeout=1.0)
    c.pool["forged"] = dataclasses.replace(c.pool["forged"], manifest=wrong)
    assert [g.group_id for g, _ in c.take(1, version=0, stopping=lambda: False)] == ["good"]
    assert c.take(1, version=0, stopping=lambda: "forged" in c.seen_groups) is None  # refused when chosen
    producer.flush()
    drops = RecordConsumer(cfg.broker, topics.DROPPED, "audit").assign(partitions=range(cfg.broker.partitions))
    (dropped,) = [r for d in drops.drain() for r in d.records]
    assert (dropped.group_id, dropped.reason, dropped.dropped_by) == ("forged", "invalid", "trainer")
    assert dropped.detail.startswith("trajectory_id")
    letters = RecordConsumer(cfg.broker, topics.DEADLETTER, "audit").assign(partitions=range(cfg.broker.partitions))
    (letter,) = [r for d in letters.drain() for r in d.records]
    assert letter.source_topic.endswith("buffer.groups") and letter.field == "trajectory_id"
    c.close()
