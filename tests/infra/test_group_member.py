"""A member of a consumer group that keeps its place without reading (``RecordConsumer.keep_place``, what a
rollout worker's prompt reader does while its one prompt ahead waits) reads every partition that comes back
to it after a rebalance took them away mid-pause: librdkafka keeps a partition's pause across rebalances."""
from __future__ import annotations

import time

from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import Prompt

PROMPTS = 40  # keyed by id: every partition gets some


def serve(step, until, what: str, timeout_s: float = 120.0) -> None:
    """``step()`` until ``until()``: every rebalance meanwhile happens inside one of its polls."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        step()


def keep_places(*members: RecordConsumer) -> None:
    for member in members:
        member.keep_place(0.2)


def test_a_member_keeping_its_place_reads_the_partitions_a_rebalance_gives_back(cfg):
    group = f"{cfg.broker.topic_prefix}keep-place-test"
    everything = set(range(cfg.broker.partitions))
    first = RecordConsumer(cfg.broker, topics.PROMPTS, group).subscribe()
    serve(lambda: keep_places(first), lambda: first.owned == everything, "the first member to own every partition")
    second = RecordConsumer(cfg.broker, topics.PROMPTS, group).subscribe()  # joins: the first's partitions are revoked
    try:
        serve(lambda: keep_places(first, second),
              lambda: first.owned and second.owned and first.owned | second.owned == everything,
              "the partitions shared by both members")
    finally:
        second.close()  # it leaves: every partition comes back to the first
    # its prompt ahead taken, the first reads again: the partitions come back during a reading poll
    def read_nothing_yet() -> None:
        assert first.poll(0.2) is None  # no prompt is published before every partition is back

    serve(read_nothing_yet, lambda: first.owned == everything, "the first member to own every partition again")
    producer = RecordProducer(cfg.broker, client_id="keep-place-test")
    for i in range(PROMPTS):
        producer.send(topics.PROMPTS, [Prompt(f"p-{i}", "chain_sum", i, "?", "1", "{}")], key=f"p-{i}")
    producer.close()
    read: set[str] = set()
    deadline = time.monotonic() + 60
    try:
        while len(read) < PROMPTS and time.monotonic() < deadline:
            if (delivery := first.poll(0.5)) is not None:
                read |= {prompt.prompt_id for prompt in delivery.records}
    finally:
        first.close()
    assert len(read) == PROMPTS, f"{PROMPTS - len(read)} prompts never read: a partition stayed paused"
