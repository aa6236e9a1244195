"""The prompt loader: task entries onto ``prompts``, so the data-set position is a consumer offset.

``feed_prompts`` keeps a bounded look-ahead of unadmitted prompts on the topic (workers count
admissions in Redis), so a run never starves however many groups get dropped, and the topic never
holds more than the look-ahead beyond what rollout has taken. Past the end of the data set it
starts the next epoch; the epoch is part of the prompt id, so every group id stays unique.
"""
from __future__ import annotations

import json
import logging
import threading
from itertools import count

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.producers.tasks import iter_prompts
from milestream.schemas import topics
from milestream.schemas.records import Prompt
from milestream.streams.credit import Credit

log = logging.getLogger(__name__)


def prompt_id(cfg: Config, epoch: int, index: int) -> str:
    """Deterministic, so a re-published prompt is recognisably the same one."""
    return f"{cfg.data.task}-s{cfg.data.seed}-e{epoch}-{index}"


def _records(cfg: Config, position: int = 0):
    """Prompts from overall position ``position`` on (epoch = position // data-set size)."""
    first_epoch, start = divmod(position, cfg.data.size)
    for epoch in count(first_epoch):
        for task_prompt in iter_prompts(cfg.data, start=start if epoch == first_epoch else 0):
            pid = prompt_id(cfg, epoch, task_prompt.index)
            yield Prompt(pid, cfg.data.task, task_prompt.index, task_prompt.question, task_prompt.answer,
                         json.dumps(task_prompt.entry))


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
    credit = Credit(cfg)
    published = start = credit.prompts_published()  # a restarted feeder carries on where it stopped
    records = _records(cfg, start)
    while not stop.is_set():
        while published - credit.prompts_admitted() < lookahead:
            record = next(records)
            producer.send(topics.PROMPTS, [record], key=record.prompt_id)
            published += 1
        producer.flush()
        credit.set_prompts_published(published)
        stop.wait(poll_s)
    return published - start
