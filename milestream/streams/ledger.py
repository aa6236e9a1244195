"""The buffer ledger: every Redis key and script of the buffer, and the invariant they keep.

    credit available + groups held = capacity

A rollout worker admits a prompt (one group) with one credit; the group holds it until it leaves the
system: trained or dropped by the trainer, or dropped by the processor. So groups in flight plus
groups buffered never exceed the capacity, and a paused trainer stalls rollout. Admission is by group
id and idempotent: a prompt redone after its worker died (its offset was never committed) keeps the
credit its first admission took, and a prompt whose group the processor already has takes none.

What the ledger keeps, per run (``redis.key_prefix`` and ``broker.topic_prefix`` name the run):

- credit: the credits available.
- admitted: the groups admitted and not yet settled by the processor (group id -> the worker that holds
  it), so a redone prompt is recognised and the groups in flight can be counted.
- queue: the groups on buffer.groups that the trainer has not taken yet, a hash of group id -> the
  group's oldest token version, so anyone can tell the queue size and the staleness of what waits.
- settlements: whether the processor is sending a group, with the outcome it chose (emitted or a drop
  reason), or has settled it, and the processor's totals over the run. The outcome chosen first stands: a
  later life that finds a group being sent sends it the same way, because its manifest or its drop may
  already be on the log (a stale pre-drop or an expiry depends on when it is decided, and a group both
  trained from an earlier life's manifest and dropped by a later life's verdict would be counted twice).
  Settling a group and its credit accounting are one atomic step: an emitted group joins the queue, a
  dropped one gives its credit back, and a group settled before (re-sent after a processor restart)
  counts nothing.
- the trainer's drops: a group the trainer dropped (stale at collection, or invalid), with the reason and
  the trainer's version then, kept before its drop record is sent. The decision stands for every later
  life of the trainer: one resumed from a checkpoint before the drop re-reads the group, and at its own
  older version would train it; it drops it again, as decided (the audit would count it trained and
  dropped: its step record and the first drop both on the log).
- taken early: the trainer can read a group before the processor has settled it (settling follows
  the broker's delivery report); such a group is noted, and settling it gives its credit back
  instead of queuing it. Either way, and however often the trainer takes it, the credit comes back once.
- the prompt feeder's position: prompts published, and prompts admitted by the workers.
- the version floor (``run.schedule`` sync and one_step): the oldest weight version an engine may hold to
  admit a prompt. The trainer raises it before it gives a batch's credit back, so the credit it frees
  admits only prompts that a version new enough will generate.
- async has its own floor, read from the same keys: a group admitted now waits behind the groups that hold
  credit (capacity less credit available), so the trainer, at its version t, will collect it at version
  t + ceil((held + 1) / trainer.batch_groups) at the latest (FIFO); an engine whose version would make the
  group staler than the bound by then admits nothing until it takes a newer version. This is what keeps
  the credit a batch frees (given back the moment the trainer announces a version, before the engines have
  it) from admitting groups that are stale before they are generated.
- the trainer's version: the newest it has announced, raised before each announcement, so a reader of
  weights.versions can tell an announcement from the future (not the trainer's) from a real one. After a
  lost broker or Redis it is set to the newest version on the log, lowered if need be.
- the log's costs: seconds the stages spent on the log over the run (rollout workers encoding and producing
  their records, the processors' CPU), so each training step can tell what the log cost while it ran.
  Figures only: a lost Redis starts them again from zero.

A resumed run finds these keys as the stopped run left them; ``reconcile`` rewrites them from the log
after the broker was lost, ``rebuild`` writes them all on a fresh Redis after Redis was lost
(log/accounting.py derives the figures for both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from milestream.config import Config
from milestream.infra.redis_client import redis_client

SENDING, SETTLED = "sending", "settled"
EMITTED = "emitted"  # a settlement's outcome; any other outcome is a drop reason

ADMITTED, READMITTED, COMPLETE, NO_CREDIT, BEHIND = "admitted", "readmitted", "complete", "no-credit", "behind"

# KEYS: credit, admitted, prompts admitted, settlements, floor, trainer version. ARGV: group id, holder, the
# holder's weight version, then (async; empty otherwise) the capacity, trainer.batch_groups and the staleness
# bound. Returns one of the above.
_ADMIT = """
if redis.call('HGET', KEYS[4], ARGV[1]) then return 'complete' end
if tonumber(ARGV[3]) < tonumber(redis.call('GET', KEYS[5]) or '0') then return 'behind' end
local trainer = redis.call('GET', KEYS[6])
if ARGV[4] and trainer then
  local ahead = tonumber(ARGV[4]) - tonumber(redis.call('GET', KEYS[1]) or '0')
  local collected_at = tonumber(trainer) + math.ceil((ahead + 1) / tonumber(ARGV[5]))
  if collected_at - tonumber(ARGV[3]) > tonumber(ARGV[6]) then return 'behind' end
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  return 'readmitted'
end
if tonumber(redis.call('GET', KEYS[1]) or '0') < 1 then return 'no-credit' end
redis.call('DECR', KEYS[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[3])
return 'admitted'
"""

# KEYS: floor (or the trainer's version). ARGV: a version. The floor never goes down (a trainer resumed from
# an older checkpoint redoes steps on groups already on the log); a missing one is set, to 0 too. Returns the floor.
_RAISE_FLOOR = """
local floor = redis.call('GET', KEYS[1])
if not floor or tonumber(ARGV[1]) > tonumber(floor) then
  redis.call('SET', KEYS[1], ARGV[1])
  return tonumber(ARGV[1])
end
return tonumber(floor)
"""

# KEYS: settlements, totals. ARGV: group id, the outcome chosen ("emitted" or a drop reason). Returns the state
# before: nil (first attempt: the outcome is recorded), 'settled', or 'sending:<outcome>' (an earlier life's
# outcome, kept).
_BEGIN = """
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous == 'settled' then return previous end
if previous then
  redis.call('HINCRBY', KEYS[2], 'groups_resent', 1)
  return previous
end
redis.call('HSET', KEYS[1], ARGV[1], 'sending:' .. ARGV[2])
return previous
"""

# KEYS: settlements, totals, credit, queue, taken early, admitted. ARGV: group id, "emitted" or the drop
# reason, the group's oldest token version. 1: this call settled the group, 0: it was settled before.
_SETTLE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == 'settled' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], 'settled')
redis.call('HDEL', KEYS[6], ARGV[1])
local taken_early = redis.call('SREM', KEYS[5], ARGV[1]) == 1
if ARGV[2] == 'emitted' then
  if taken_early then
    redis.call('INCR', KEYS[3])
  else
    redis.call('HSET', KEYS[4], ARGV[1], ARGV[3])
  end
  redis.call('HINCRBY', KEYS[2], 'groups_out', 1)
else
  redis.call('INCR', KEYS[3])
  redis.call('HINCRBY', KEYS[2], 'dropped_' .. ARGV[2], 1)
end
return 1
"""

# KEYS: queue, credit, taken early, settlements. ARGV: group id. 1: left now, 0: had left before.
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


@dataclass(frozen=True)
class LedgerKeys:
    """The Redis key of each part of one run's ledger (the layout resumed runs rely on)."""

    credit: str
    admitted: str  # hash: group id -> holder
    queue: str  # hash: group id -> oldest token version
    taken_early: str  # set of group ids
    settlements: str  # hash: group id -> "sending:<outcome>" / SETTLED
    totals: str  # hash: the processor's counts over the run
    prompts_admitted: str
    prompts_published: str
    version_floor: str
    trainer_version: str
    trainer_drops: str  # hash: group id -> "<version>:<reason>" (TrainerDrop)
    log_costs: str  # hash: cost name -> seconds over the run

    @classmethod
    def of(cls, cfg: Config) -> "LedgerKeys":
        namespace = f"{cfg.redis.key_prefix}:{cfg.broker.topic_prefix}"
        return cls(namespace + "credit", namespace + "admitted", namespace + "queued", namespace + "taken-early",
                   namespace + "processor-groups", namespace + "processor-totals",
                   namespace + "prompts-admitted", namespace + "prompts-published", namespace + "version-floor",
                   namespace + "trainer-version", namespace + "trainer-drops", namespace + "log-costs")


@dataclass(frozen=True)
class Begun:
    """What beginning to send a group found: its state before (None: the first attempt, SENDING, SETTLED) and,
    when an earlier life had begun to send it, the outcome that life chose (EMITTED or a drop reason)."""

    before: str | None
    decided: str | None = None


@dataclass(frozen=True)
class TrainerDrop:
    """How the trainer dropped a group: the reason, at which of its versions."""

    reason: str
    version: int

    def encoded(self) -> str:
        return f"{self.version}:{self.reason}"

    @classmethod
    def decoded(cls, value: bytes) -> "TrainerDrop":
        version, _, reason = value.decode().partition(":")
        return cls(reason, int(version))


@dataclass(frozen=True)
class Reconciled:
    """What a resumed run's ledger is rewritten to (see log/restore.py ``derive_accounting``)."""

    credit: int
    queue: Mapping[str, int]  # group id -> oldest token version
    prompts_admitted: int
    unsettled: tuple[str, ...] = ()  # groups to forget as settled: the processor redoes them
    admitted: tuple[str, ...] = ()  # groups in flight: admitted, not settled, their prompts not to be read again
    trainer_version: int | None = None  # the newest version announced on the log; None: left as it is


class BufferLedger:
    def __init__(self, cfg: Config):
        self.client = redis_client(cfg.redis, socket_timeout=10)
        self.keys = LedgerKeys.of(cfg)
        self.capacity = cfg.buffer_capacity
        # async: the bound a group's staleness at collection must stay within to be admitted (see the docstring)
        self.projection = [] if cfg.admission_lead is not None else [self.capacity, cfg.trainer.batch_groups,
                                                                     cfg.staleness_bound]
        self._admit = self.client.register_script(_ADMIT)
        self._begin = self.client.register_script(_BEGIN)
        self._settle = self.client.register_script(_SETTLE)
        self._leave = self.client.register_script(_LEAVE)
        self._raise_floor = self.client.register_script(_RAISE_FLOOR)

    def initialise(self) -> None:
        """Set the credit to the full capacity, unless a run already holds it (restart keeps it)."""
        self.client.set(self.keys.credit, self.capacity, nx=True)

    # rollout workers: a credit per admitted group
    def admit(self, group_id: str, holder: str, version: int) -> str:
        """ADMITTED (a credit taken), READMITTED (admitted before, by a worker that died or stopped: it keeps
        that credit), COMPLETE (the processor has the whole group: nothing to redo), BEHIND (the holder's
        engine, at ``version``, is older than the version floor, or in async would make the group stale at
        its collection) or NO_CREDIT."""
        keys = [self.keys.credit, self.keys.admitted, self.keys.prompts_admitted, self.keys.settlements,
                self.keys.version_floor, self.keys.trainer_version]
        return _text(self._admit(keys=keys, args=[group_id, holder, version, *self.projection]))

    def raise_floor(self, version: int) -> int:
        """Admit nothing more on an engine older than ``version`` (never lowered); returns the floor."""
        return int(self._raise_floor(keys=[self.keys.version_floor], args=[version]))

    def version_floor(self) -> int:
        return int(self.client.get(self.keys.version_floor) or 0)

    def raise_trainer_version(self, version: int) -> int:
        """The trainer is about to announce ``version`` (never lowered: a resumed trainer re-announces)."""
        return int(self._raise_floor(keys=[self.keys.trainer_version], args=[version]))

    def trainer_version(self) -> int | None:
        """The newest version the trainer announced (``milestream run`` starts it at 0); None where nothing
        set it (a test's ledger): no bound."""
        value = self.client.get(self.keys.trainer_version)
        return None if value is None else int(value)

    def is_admitted(self, group_id: str) -> bool:
        """Whether a rollout worker admitted the group and the processor has not settled it yet."""
        return bool(self.client.hexists(self.keys.admitted, group_id))

    def in_flight(self) -> dict[str, str]:
        """The groups admitted and not settled yet: group id -> the worker that holds it."""
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.keys.admitted).items()}

    def available(self) -> int:
        return int(self.client.get(self.keys.credit) or 0)

    # the processor: each group settled once
    def settlement(self, group_id: str) -> str | None:
        """SENDING, SETTLED, or None when the processor never began to send the group."""
        return _begun(self.client.hget(self.keys.settlements, group_id)).before

    def begin_sending(self, group_id: str, outcome: str = EMITTED) -> Begun:
        """Mark the group as being sent as ``outcome`` (EMITTED or a drop reason); returns what was there before
        (``Begun.decided``: the outcome an earlier life chose, which stands)."""
        return _begun(self._begin(keys=[self.keys.settlements, self.keys.totals], args=[group_id, outcome]))

    def settle(self, group_id: str, outcome: str, oldest_version: int = -1) -> bool:
        """``outcome``: EMITTED or the drop reason. False when the group had been settled before."""
        keys = [self.keys.settlements, self.keys.totals, self.keys.credit, self.keys.queue, self.keys.taken_early,
                self.keys.admitted]
        return bool(self._settle(keys=keys, args=[group_id, outcome, oldest_version]))

    # the same, for a batch of groups in one round trip (the processor asks once per batch of records)
    def recall(self, group_ids: Sequence[str]) -> dict[str, tuple[str | None, bool]]:
        """Per group: its settlement (as ``settlement``) and whether a rollout worker admitted it."""
        if not group_ids:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.settlements, list(group_ids))
            pipe.hmget(self.keys.admitted, list(group_ids))
            settlements, admitted = pipe.execute()
        return {g: (_begun(s).before, a is not None) for g, s, a in zip(group_ids, settlements, admitted)}

    def begin_sending_many(self, decisions: Sequence[tuple[str, str]]) -> list[Begun]:
        """``begin_sending`` of each (group id, outcome), in order."""
        keys = [self.keys.settlements, self.keys.totals]
        with self.client.pipeline(transaction=False) as pipe:
            for group_id, outcome in decisions:
                self._begin(keys=keys, args=[group_id, outcome], client=pipe)
            return [_begun(v) for v in pipe.execute()]

    def decided(self, group_ids: Sequence[str]) -> dict[str, str]:
        """The outcome chosen for each of the groups that a processor has begun, not finished, sending."""
        if not group_ids:
            return {}
        found = self.client.hmget(self.keys.settlements, list(group_ids))
        return {g: begun.decided for g, value in zip(group_ids, found) if (begun := _begun(value)).decided}

    def settle_many(self, settlements: Sequence[tuple[str, str, int]]) -> list[bool]:
        """``settle`` of each (group id, outcome, oldest version), in order."""
        keys = [self.keys.settlements, self.keys.totals, self.keys.credit, self.keys.queue, self.keys.taken_early,
                self.keys.admitted]
        with self.client.pipeline(transaction=False) as pipe:
            for group_id, outcome, oldest in settlements:
                self._settle(keys=keys, args=[group_id, outcome, oldest], client=pipe)
            return [bool(v) for v in pipe.execute()]

    def sent(self, group_ids: Sequence[str]) -> tuple[set[str], dict[str, TrainerDrop]]:
        """Those of the groups the processor has begun to send, in any of its lives, and those of them the trainer
        dropped, in any of its lives (``drop_for_good``), with how."""
        if not group_ids:
            return set(), {}
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.settlements, list(group_ids))
            pipe.hmget(self.keys.trainer_drops, list(group_ids))
            settlements, drops = pipe.execute()
        return ({g for g, state in zip(group_ids, settlements) if state is not None},
                {g: TrainerDrop.decoded(drop) for g, drop in zip(group_ids, drops) if drop is not None})

    def settled_or_sending(self) -> set[str]:
        """Every group the processor has begun to send, in any of its lives."""
        return {key.decode() for key in self.client.hkeys(self.keys.settlements)}

    def run_totals(self) -> dict[str, int]:
        """The processor's counts over the whole run, across its restarts."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.keys.totals).items()}

    # the trainer: a group leaves the queue, and gives its credit back, once
    def leave(self, group_id: str) -> bool:
        """The trainer took or dropped the group. False when it had left before."""
        keys = [self.keys.queue, self.keys.credit, self.keys.taken_early, self.keys.settlements]
        return bool(self._leave(keys=keys, args=[group_id]))

    def drop_for_good(self, group_id: str, drop: TrainerDrop) -> TrainerDrop:
        """The trainer drops the group: kept unless a life of it dropped the group before; returns the drop that
        stands (the first)."""
        with self.client.pipeline(transaction=True) as tx:
            tx.hsetnx(self.keys.trainer_drops, group_id, drop.encoded())
            tx.hget(self.keys.trainer_drops, group_id)
            return TrainerDrop.decoded(tx.execute()[1])

    def queued(self) -> int:
        return int(self.client.hlen(self.keys.queue))

    def queued_versions(self) -> list[int]:
        """The oldest token version of each group in the queue."""
        return [int(v) for v in self.client.hvals(self.keys.queue)]

    def figures(self, version: int) -> dict[str, float]:
        """Credit available, queue size and the staleness at ``version`` of the groups waiting in it."""
        lags = [version - oldest for oldest in self.queued_versions()]
        return {"queue_size": float(len(lags)), "queue_staleness_mean": sum(lags) / len(lags) if lags else 0.0,
                "queue_staleness_max": float(max(lags, default=0)), "credit_available": float(self.available())}

    def balance(self) -> dict[str, int]:
        """The invariant's terms: credit available + groups queued + groups admitted and not yet settled by
        the processor = capacity. ``unaccounted`` is the difference: a credit leaked (positive) or returned
        twice (negative); 0 in a sound run, at any moment (each term changes only inside a script)."""
        available, queued, in_flight = self.available(), self.queued(), int(self.client.hlen(self.keys.admitted))
        return {"capacity": self.capacity, "available": available, "queued": queued, "in_flight": in_flight,
                "unaccounted": self.capacity - available - queued - in_flight}

    # what the log costs the stages
    def add_log_costs(self, seconds: Mapping[str, float]) -> None:
        """Add to the run's totals of each named cost (e.g. ``rollout_encode_s``, ``processor_cpu_s``)."""
        with self.client.pipeline(transaction=False) as pipe:
            for name, value in seconds.items():
                pipe.hincrbyfloat(self.keys.log_costs, name, value)
            pipe.execute()

    def log_costs(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.client.hgetall(self.keys.log_costs).items()}

    # the prompt feeder keeps a bounded look-ahead of prompts beyond what workers have admitted
    def prompts_admitted(self) -> int:
        return int(self.client.get(self.keys.prompts_admitted) or 0)

    def prompts_published(self) -> int:
        return int(self.client.get(self.keys.prompts_published) or 0)

    def set_prompts_published(self, position: int) -> None:
        self.client.set(self.keys.prompts_published, position)

    # a run resumed after its broker was lost
    def reconcile(self, figures: Reconciled) -> None:
        """Rewrite the ledger in one transaction; call with every stage stopped."""
        with self.client.pipeline(transaction=True) as tx:
            tx.set(self.keys.credit, figures.credit)
            tx.delete(self.keys.queue, self.keys.taken_early, self.keys.admitted)
            if figures.queue:
                tx.hset(self.keys.queue, mapping=dict(figures.queue))
            if figures.admitted:
                tx.hset(self.keys.admitted, mapping={group: "restored" for group in figures.admitted})
            tx.set(self.keys.prompts_admitted, figures.prompts_admitted)
            if figures.unsettled:
                tx.hdel(self.keys.settlements, *figures.unsettled)
            if figures.trainer_version is not None:  # lowered too: past it, a killed trainer's phantom
                tx.set(self.keys.trainer_version, figures.trainer_version)
            tx.execute()

    # a run whose Redis was lost: a fresh server holds nothing, so every key comes back from the log
    def rebuild(self, figures: Reconciled, settled: Iterable[str], totals: Mapping[str, int],
                prompts_published: int, trainer_drops: Mapping[str, TrainerDrop] | None = None) -> None:
        """``reconcile`` on a fresh Redis, plus what it keeps of a surviving one: the groups the processor
        settled (every group with an outcome on the log), its run totals, the feeder's position and the
        trainer's drops (those on the log). Call with every stage stopped."""
        with self.client.pipeline(transaction=True) as tx:
            tx.delete(self.keys.settlements, self.keys.totals, self.keys.trainer_drops)
            if settled := list(settled):
                tx.hset(self.keys.settlements, mapping=dict.fromkeys(settled, SETTLED))
            if trainer_drops:
                tx.hset(self.keys.trainer_drops, mapping={g: d.encoded() for g, d in trainer_drops.items()})
            if totals:
                tx.hset(self.keys.totals, mapping=dict(totals))
            tx.set(self.keys.prompts_published, prompts_published)
            tx.execute()
        self.reconcile(figures)


def _text(value: bytes | None) -> str | None:
    return value.decode() if value is not None else None


def _begun(value: bytes | None) -> Begun:
    """A settlements value read: None, SETTLED or "sending:<outcome>"."""
    text = _text(value)
    if text is None or text == SETTLED:
        return Begun(text)
    state, _, outcome = text.partition(":")
    return Begun(state, outcome or None)
