"""The prompt loader: task entries onto ``prompts``, so the data-set position is a consumer offset."""
from __future__ import annotations

import json
import logging

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.producers.tasks import iter_prompts
from milestream.schemas import topics
from milestream.schemas.records import Prompt

log = logging.getLogger(__name__)


def prompt_id(cfg: Config, index: int) -> str:
    """Deterministic, so a re-published prompt is recognisably the same one."""
    return f"{cfg.data.task}-s{cfg.data.seed}-{index}"


def load_prompts(cfg: Config, start: int = 0, count: int = 1000) -> int:
    producer = RecordProducer(cfg.broker, client_id="prompt-loader")
    published = 0
    for task_prompt in iter_prompts(cfg.data, start=start, stop=start + count):
        pid = prompt_id(cfg, task_prompt.index)
        record = Prompt(pid, cfg.data.task, task_prompt.index, task_prompt.question, task_prompt.answer,
                        json.dumps(task_prompt.entry))
        producer.send(topics.PROMPTS, [record], key=pid)
        published += 1
    producer.flush()
    log.info("published prompts %d..%d of %s", start, start + published - 1, cfg.data.task)
    return published
