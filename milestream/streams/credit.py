"""The buffer's bound, shared through Redis as credit.

A rollout worker takes one credit before it admits a prompt (one group); the credit comes back when
that group leaves the system: trained or dropped by the trainer, or dropped by the processor. So
groups in flight plus groups buffered never exceed the capacity, and a paused trainer stalls rollout.

The queue (groups on buffer.groups that the trainer has not taken yet) is a Redis hash of group id
-> the group's oldest token version, so anyone can tell the queue size and the staleness of what
waits in it. The processor adds a group when it settles it; the trainer removes it when it takes or
drops it, and that removal gives the credit back. The trainer can read a group before the processor
has settled it (settling follows the broker's delivery report): such a group is noted as taken
early, and settling it then gives its credit back instead of queuing it.
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

# KEYS: queued, credit, taken early, group states. ARGV: group id. 1: left now, 0: had left before.
_LEAVE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('INCR', KEYS[2])
  return 1
end
if redis.call('HGET', KEYS[4], ARGV[1]) ~= 'settled' then
  return redis.call('SADD', KEYS[3], ARGV[1])
end
return 0
"""


class Credit:
    def __init__(self, cfg: Config):
        self.client = redis.Redis.from_url(cfg.redis.url, socket_timeout=10)
        namespace = f"{cfg.redis.key_prefix}:{cfg.broker.topic_prefix}"
        self.key = namespace + "credit"
        self.queued_key = namespace + "queued"  # hash: group id -> oldest token version
        self.taken_early_key = namespace + "taken-early"
        self.group_states_key = namespace + "processor-groups"  # see streams.processor.Settlements
        self.admitted_key = namespace + "prompts-admitted"
        self.published_key = namespace + "prompts-published"
        self.capacity = cfg.buffer_capacity
        self._take = self.client.register_script(_TAKE)
        self._leave = self.client.register_script(_LEAVE)

    def initialise(self) -> None:
        """Set the credit to the full capacity, unless a run already holds it (restart keeps it)."""
        self.client.set(self.key, self.capacity, nx=True)

    def try_take(self, groups: int = 1) -> bool:
        return int(self._take(keys=[self.key], args=[groups])) >= 0

    def give_back(self, groups: int = 1) -> None:
        self.client.incrby(self.key, groups)

    def available(self) -> int:
        return int(self.client.get(self.key) or 0)

    def leave(self, group_id: str) -> bool:
        """The trainer took or dropped the group: it leaves the queue and gives its credit back, once."""
        keys = [self.queued_key, self.key, self.taken_early_key, self.group_states_key]
        return bool(self._leave(keys=keys, args=[group_id]))

    def queued(self) -> int:
        return int(self.client.hlen(self.queued_key))

    def queued_versions(self) -> list[int]:
        """The oldest token version of each group in the queue."""
        return [int(v) for v in self.client.hvals(self.queued_key)]

    def queue_figures(self, version: int) -> dict[str, float]:
        """Queue size and the staleness at ``version`` of the groups waiting in it."""
        lags = [version - oldest for oldest in self.queued_versions()]
        return {"queue_size": float(len(lags)), "queue_staleness_mean": sum(lags) / len(lags) if lags else 0.0,
                "queue_staleness_max": float(max(lags, default=0))}

    # The prompt feeder keeps a bounded look-ahead of prompts beyond what workers have admitted.
    def prompt_admitted(self) -> None:
        self.client.incr(self.admitted_key)

    def prompts_admitted(self) -> int:
        return int(self.client.get(self.admitted_key) or 0)

    def prompts_published(self) -> int:
        return int(self.client.get(self.published_key) or 0)

    def set_prompts_published(self, position: int) -> None:
        self.client.set(self.published_key, position)
