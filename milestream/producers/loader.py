"""The prompt loader: the data set's prompts (producers/data.py) onto ``prompts``, so the data-set
position is a consumer offset.

``feed_prompts`` keeps a bounded look-ahead of unadmitted prompts on the topic (workers count
admissions in Redis), so a run never starves however many groups get dropped, and the topic never
holds more than the look-ahead beyond what rollout has taken. Its position (prompts published, in
Redis) is a position in the deterministic prompt stream; the epoch is part of the prompt id, so every
group id stays unique.

With ``buffer.unused: retry`` it is also the retry handler: the prompt of a group dropped for one of
``buffer.retry_reasons`` goes back on ``prompts`` as the next attempt (a new group id), at most
``buffer.max_retries`` times.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import threading
from itertools import islice

from milestream.config import Config
from milestream.infra import faults
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.offsets import Checkpoint
from milestream.producers.data import prompt_stream, source_named, sources
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger

log = logging.getLogger(__name__)


def parse_group_id(cfg: Config, group_id: str) -> tuple[str, int, int, int]:
    """(source, epoch, row, attempt) of a group id made from a prompt id (producers/data.py) and an attempt."""
    match = re.fullmatch(rf"(.+)-s{cfg.data.seed}-e(\d+)-(\d+)#(\d+)", group_id)
    if match is None or match.group(1) not in {source.name for source in sources(cfg)}:
        raise ValueError(f"group id {group_id!r} was not made by this data set's loader")
    epoch, row, attempt = map(int, match.groups()[1:])
    return match.group(1), epoch, row, attempt


def retry_unused(cfg: Config, dropped: RecordConsumer, producer: RecordProducer) -> int:
    """Put the prompts of retryable dropped groups back on ``prompts``; returns how many."""
    retried = 0
    offsets: dict[int, int] = {}
    for delivery in dropped.drain(idle_s=0.05, max_wait_s=1.0):
        offsets[delivery.position.partition] = delivery.position.offset + 1
        for record in delivery.records:
            if record.reason not in cfg.buffer.retry_reasons:
                continue
            try:
                source, epoch, row, attempt = parse_group_id(cfg, record.group_id)
            except ValueError as exc:
                log.warning("not retried: %s", exc)
                continue
            if attempt >= cfg.buffer.max_retries:
                continue
            prompt = source_named(cfg, source).prompt(epoch, row)
            producer.send(topics.PROMPTS, [dataclasses.replace(prompt, attempt=attempt + 1)], key=prompt.prompt_id)
            retried += 1
    if offsets:  # committed only once the retries are on the log
        Checkpoint(producer, dropped, lambda: offsets).commit()
    return retried


def load_prompts(cfg: Config, start: int = 0, count: int = 1000) -> int:
    """Publish ``count`` prompts from data-set position ``start`` (fewer where the data set ends)."""
    producer = RecordProducer(cfg.broker, client_id="prompt-loader")
    published = 0
    for record in islice(prompt_stream(cfg, start), count):
        producer.send(topics.PROMPTS, [record], key=record.prompt_id)
        published += 1
    producer.flush()
    log.info("published %d prompts from position %d", published, start)
    return published


def feed_prompts(cfg: Config, lookahead: int, stop: threading.Event, poll_s: float = 0.5) -> int:
    """Keep ``lookahead`` prompts ahead of the rollout workers' admissions until ``stop`` is set
    (or, with ``data.epochs``, the data set ends)."""
    producer = RecordProducer(cfg.broker, client_id="prompt-feeder")
    ledger = BufferLedger(cfg)
    published = start = ledger.prompts_published()  # a restarted feeder carries on where it stopped
    records = prompt_stream(cfg, start)
    dropped = None
    if cfg.buffer.unused == "retry":
        dropped = RecordConsumer(cfg.broker, topics.DROPPED, f"{cfg.broker.topic_prefix}retry", deadletter=producer)
        dropped.subscribe()
    retried = 0  # retried prompts are admitted too: they count against the look-ahead
    ended = False
    faults.hold("loader.publishing")
    while not stop.is_set():
        if dropped is not None:
            retried += retry_unused(cfg, dropped, producer)
        while not ended and published + retried - ledger.prompts_admitted() < lookahead:
            record = next(records, None)
            ended = record is None
            if ended:
                log.info("the data set ends after %d prompts (data.epochs %s)", published, cfg.data.epochs)
                break
            producer.send(topics.PROMPTS, [record], key=record.prompt_id)
            published += 1
        producer.flush()
        ledger.set_prompts_published(published)
        stop.wait(poll_s)
    return published - start
