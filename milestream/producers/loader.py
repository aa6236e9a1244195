"""The prompt loader: task entries onto ``prompts``, so the data-set position is a consumer offset.

``feed_prompts`` keeps a bounded look-ahead of unadmitted prompts on the topic (workers count
admissions in Redis), so a run never starves however many groups get dropped, and the topic never
holds more than the look-ahead beyond what rollout has taken. Past the end of the data set it
starts the next epoch; the epoch is part of the prompt id, so every group id stays unique.

With ``buffer.unused: retry`` it is also the retry handler: the prompt of a group dropped for one of
``buffer.retry_reasons`` goes back on ``prompts`` as the next attempt (a new group id), at most
``buffer.max_retries`` times.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from itertools import count

from milestream.config import Config
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.producers.tasks import iter_prompts
from milestream.schemas import topics
from milestream.schemas.records import Prompt
from milestream.streams.ledger import BufferLedger

log = logging.getLogger(__name__)


def prompt_id(cfg: Config, epoch: int, index: int) -> str:
    """Deterministic, so a re-published prompt is recognisably the same one."""
    return f"{cfg.data.task}-s{cfg.data.seed}-e{epoch}-{index}"


def parse_group_id(cfg: Config, group_id: str) -> tuple[int, int, int]:
    """(epoch, index, attempt) of a group id made from ``prompt_id`` and an attempt number."""
    match = re.fullmatch(rf"{re.escape(cfg.data.task)}-s{cfg.data.seed}-e(\d+)-(\d+)#(\d+)", group_id)
    if match is None:
        raise ValueError(f"group id {group_id!r} was not made by this data set's loader")
    epoch, index, attempt = map(int, match.groups())
    return epoch, index, attempt


def _records(cfg: Config, position: int = 0):
    """Prompts from overall position ``position`` on (epoch = position // data-set size)."""
    first_epoch, start = divmod(position, cfg.data.size)
    for epoch in count(first_epoch):
        for task_prompt in iter_prompts(cfg.data, start=start if epoch == first_epoch else 0):
            pid = prompt_id(cfg, epoch, task_prompt.index)
            yield Prompt(pid, cfg.data.task, task_prompt.index, task_prompt.question, task_prompt.answer,
                         json.dumps(task_prompt.entry))


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
                epoch, index, attempt = parse_group_id(cfg, record.group_id)
            except ValueError as exc:
                log.warning("not retried: %s", exc)
                continue
            if attempt >= cfg.buffer.max_retries:
                continue
            prompt = next(_records(cfg, epoch * cfg.data.size + index))
            producer.send(topics.PROMPTS, [dataclasses.replace(prompt, attempt=attempt + 1)], key=prompt.prompt_id)
            retried += 1
    if offsets:
        producer.flush()  # committed only once the retries are on the log
        dropped.commit(offsets)
    return retried


def load_prompts(cfg: Config, start: int = 0, count: int = 1000) -> int:
    """Publish ``count`` prompts from data-set position ``start``."""
    producer = RecordProducer(cfg.broker, client_id="prompt-loader")
    records = _records(cfg, start)
    for _ in range(count):
        record = next(records)
        producer.send(topics.PROMPTS, [record], key=record.prompt_id)
    producer.flush()
    log.info("published %d prompts of %s from position %d", count, cfg.data.task, start)
    return count


def feed_prompts(cfg: Config, lookahead: int, stop: threading.Event, poll_s: float = 0.5) -> int:
    """Keep ``lookahead`` prompts ahead of the rollout workers' admissions until ``stop`` is set."""
    producer = RecordProducer(cfg.broker, client_id="prompt-feeder")
    ledger = BufferLedger(cfg)
    published = start = ledger.prompts_published()  # a restarted feeder carries on where it stopped
    records = _records(cfg, start)
    dropped = None
    if cfg.buffer.unused == "retry":
        dropped = RecordConsumer(cfg.broker, topics.DROPPED, f"{cfg.broker.topic_prefix}retry", deadletter=producer)
        dropped.subscribe()
    retried = 0  # retried prompts are admitted too: they count against the look-ahead
    while not stop.is_set():
        if dropped is not None:
            retried += retry_unused(cfg, dropped, producer)
        while published + retried - ledger.prompts_admitted() < lookahead:
            record = next(records)
            producer.send(topics.PROMPTS, [record], key=record.prompt_id)
            published += 1
        producer.flush()
        ledger.set_prompts_published(published)
        stop.wait(poll_s)
    return published - start
