"""The prompt feeder against the real broker and Redis: look-ahead, restart position, retries."""
from __future__ import annotations

import threading
import time

from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.producers.loader import feed_prompts, load_prompts, parse_group_id, retry_unused
from milestream.schemas import topics
from milestream.schemas.records import Dropped
from milestream.streams.ledger import BufferLedger


def read_prompts(cfg, group: str):
    consumer = RecordConsumer(cfg.broker, topics.PROMPTS, group).assign(partitions=range(cfg.broker.partitions))
    records = [r for d in consumer.drain(idle_s=1.0) for r in d.records]
    consumer.close()
    return records


def run_feeder(cfg, seconds: float) -> int:
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.start()
    return feed_prompts(cfg, lookahead=5, stop=stop, poll_s=0.1)


def test_feeder_keeps_a_bounded_lookahead_and_resumes_its_position(cfg):
    assert run_feeder(cfg, 1.0) == 5
    credit = BufferLedger(cfg)
    for group in ("a#0", "b#0", "c#0", "a#0"):  # a redone prompt (a#0) is not admitted twice
        credit.admit(group, "w-test", 0)
    assert run_feeder(cfg, 1.0) == 3  # tops up to 5 ahead, carrying on from position 5
    ids = [p.prompt_id for p in read_prompts(cfg, "audit")]
    assert sorted(ids, key=lambda i: int(i.rsplit("-", 1)[1])) == [f"chain_sum-s42-e0-{i}" for i in range(8)]


def test_prompt_ids_wrap_into_the_next_epoch(cfg):
    cfg = cfg.with_overrides(data={"size": 3})
    load_prompts(cfg, start=2, count=3)
    ids = sorted(p.prompt_id for p in read_prompts(cfg, "audit"))
    assert ids == ["chain_sum-s42-e0-2", "chain_sum-s42-e1-0", "chain_sum-s42-e1-1"]
    assert parse_group_id(cfg, "chain_sum-s42-e1-1#0") == ("chain_sum", 1, 1, 0)


def test_unused_groups_are_retried_once_with_a_new_group_id(cfg):
    cfg = cfg.with_overrides(buffer={"unused": "retry", "max_retries": 1})
    load_prompts(cfg, count=2)
    original = {p.prompt_id: p for p in read_prompts(cfg, "before")}
    producer = RecordProducer(cfg.broker)
    for group_id, reason in [("chain_sum-s42-e0-0#0", "stale"), ("chain_sum-s42-e0-1#0", "filtered"),
                             ("chain_sum-s42-e0-1#1", "stale")]:
        producer.send(topics.DROPPED, [Dropped(group_id, "p", reason, "", "test", 2, 0, 3, 0.0, time.time())],
                      key=group_id)
    producer.flush()
    dropped = RecordConsumer(cfg.broker, topics.DROPPED, "retry").subscribe()
    retried = 0
    deadline = time.monotonic() + 30
    while retried == 0 and time.monotonic() < deadline:
        retried += retry_unused(cfg, dropped, producer)
    assert retried == 1  # filtered is not a retry reason; attempt 1 already used the one retry
    (retry,) = [p for p in read_prompts(cfg, "after") if p.attempt == 1]
    first = original["chain_sum-s42-e0-0"]
    assert (retry.prompt_id, retry.question, retry.group_id) == (first.prompt_id, first.question, "chain_sum-s42-e0-0#1")
    dropped.close()
