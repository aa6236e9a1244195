"""The JSONL log of buffer.metrics: one line per record with source, step, version and ts; a writer
started again on the same file repairs a torn last line and writes each record once."""
from __future__ import annotations

import json
import time

from metrics_records import METRICS_RECORDS, STEPS, publish_run

from milestream.observe.feed import FEED_TOPICS, TopicFeed
from milestream.observe.jsonl import JsonlWriter
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import Metrics


def write_log(cfg, path) -> JsonlWriter:
    writer, feed = JsonlWriter(path), TopicFeed(cfg, "jsonl-test", specs=[topics.METRICS])
    try:
        for item in feed.drain(idle_s=1.0):
            writer.observe(item)
    finally:
        feed.close()
        writer.close()
    return writer


def test_one_line_per_record_resumed_once(cfg, tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    publish_run(cfg)
    assert write_log(cfg, path).written == METRICS_RECORDS  # the bad value is skipped, not logged
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    trainer = [line for line in lines if line["source"] == "trainer"]
    assert [(line["step"], line["version"]) for line in trainer] == [(1, 1), (2, 2), (2, 2), (3, 3), (4, 4)]
    assert trainer[-1]["values"]["reward_mean"] == 0.4 and trainer[-1]["ts"] > 0
    by_source = {line["source"]: line for line in lines}
    assert by_source["processor"]["version"] == 2 and by_source["rollout/worker-0"]["version"] == 2
    assert by_source["verifier"]["version"] is None

    # a writer killed mid-line, then started again after one more record: the torn line goes, the
    # records already in the file are not written again, the new one is
    with open(path, "a") as out:
        out.write('{"offset": 99, "sou')
    producer = RecordProducer(cfg.broker)
    producer.send(topics.METRICS, [Metrics("trainer", STEPS + 1, time.time(), {"reward_mean": 0.5})], key="trainer")
    producer.flush()
    assert write_log(cfg, path).written == 1
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert again[:-1] == lines
    assert (again[-1]["offset"], again[-1]["step"], again[-1]["version"]) == (METRICS_RECORDS + 1, STEPS + 1, None)


def test_a_feed_told_to_stop_as_it_starts_still_reads_to_the_end(cfg, tmp_path):
    """A stage stopped while it was starting (the tracker restarted just before the run ended) drains a feed
    that has fetched nothing yet: quiet is no end, the end offsets the broker reports are. With no quiet wait
    at all, every record is still read."""
    publish_run(cfg)
    feed = TopicFeed(cfg, "drain-test", specs=FEED_TOPICS)
    try:
        drained = feed.drain(idle_s=0.0)
    finally:
        feed.close()
    trainer = [item.record.step for item in drained if item.spec is topics.METRICS and item.record.source == "trainer"]
    assert trainer == [1, 2, 2, 3, 4]
    assert sum(item.spec is topics.WEIGHTS_APPLIED for item in drained) == 3
