"""The buffer's bound, shared through Redis as credit.

A rollout worker takes one credit before it admits a prompt (one group); the credit comes back when
that group leaves the system: trained or dropped by the trainer, or dropped by the processor. So
groups in flight plus groups buffered never exceed the capacity, and a paused trainer stalls rollout.
"""
from __future__ import annotations

import redis

from milestream.config import Config

_TAKE = """
local available = tonumber(redis.call('GET', KEYS[1]) or '0')
if available >= tonumber(ARGV[1]) then
  return redis.call('DECRBY', KEYS[1], ARGV[1])
end
return -1
"""


class Credit:
    def __init__(self, cfg: Config):
        self.client = redis.Redis.from_url(cfg.redis.url, socket_timeout=10)
        namespace = f"{cfg.redis.key_prefix}:{cfg.broker.topic_prefix}"
        self.key = namespace + "credit"
        self.queued_key = namespace + "queued"
        self.admitted_key = namespace + "prompts-admitted"
        self.published_key = namespace + "prompts-published"
        self.capacity = cfg.buffer_capacity
        self._take = self.client.register_script(_TAKE)

    def initialise(self) -> None:
        """Set the credit to the full capacity, unless a run already holds it (restart keeps it)."""
        self.client.set(self.key, self.capacity, nx=True)
        self.client.set(self.queued_key, 0, nx=True)

    def try_take(self, groups: int = 1) -> bool:
        return int(self._take(keys=[self.key], args=[groups])) >= 0

    def give_back(self, groups: int = 1) -> None:
        self.client.incrby(self.key, groups)

    def available(self) -> int:
        return int(self.client.get(self.key) or 0)

    # Groups on buffer.groups not yet collected by the trainer: the queue size metric.
    def enqueued(self, groups: int = 1) -> None:
        self.client.incrby(self.queued_key, groups)

    def dequeued(self, groups: int = 1) -> None:
        self.client.decrby(self.queued_key, groups)

    def queued(self) -> int:
        return int(self.client.get(self.queued_key) or 0)

    # The prompt feeder keeps a bounded look-ahead of prompts beyond what workers have admitted.
    def prompt_admitted(self) -> None:
        self.client.incr(self.admitted_key)

    def prompts_admitted(self) -> int:
        return int(self.client.get(self.admitted_key) or 0)

    def prompts_published(self) -> int:
        return int(self.client.get(self.published_key) or 0)

    def set_prompts_published(self, position: int) -> None:
        self.client.set(self.published_key, position)
