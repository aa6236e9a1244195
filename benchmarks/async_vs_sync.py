"""Trained tokens/s of the synchronous schedule against milestream's fully asynchronous one, same engines.

Both schedules drive one modelled engine pool, in simulated time, over the same long-tail sequence of
trajectory lengths (the k-th sample admitted gets the k-th length of one seeded draw):

- sync: admit a batch of ``trainer.batch_groups`` groups, generate until its slowest trajectory ends,
  train on it, update the weights; engines wait while the trainer trains and the trainer waits while
  they generate.
- async (milestream's schedule): workers admit a group whenever the buffer has credit and refill slots
  sample by sample; a finished group is settled into the buffer; the trainer takes
  ``trainer.batch_groups`` groups whenever it is free and the pool holds them, dropping groups past
  ``buffer.max_staleness``; each new version pauses the engines while it loads, generation goes on.

Real: the buffer bound and its accounting run through milestream's own code on a real redis-server —
``streams.ledger.BufferLedger`` (take on admission, settle, leave on take / stale drop)
(a finished group settled as emitted, queued in Redis), the data selector named by ``buffer.selector``
(``train.collector.fifo``) over ``PooledGroup``s, and ``streams.groups`` staleness; the knobs are the
Config's (batch groups, group size, buffer capacity, staleness bound). Left out: the processor's early
stale drop (the trainer's drop at collection catches the same groups later) and broker latency.
Modelled (and printed under ``model``): engine speed — continuous batching, every active sequence gains
one token per decode step, and a step takes ``step_base_s + step_per_seq_s * batch``; prefill is not
modelled; the trainer's step time, ``train_base_s + train_per_token_s * tokens``; the weight-update
pause; the trajectory lengths, lognormal with a cap. No model runs and no broker is used.

Prints one JSON line: ``sync_tokens_s``, ``async_tokens_s``, ``speedup`` (async / sync; goal >= 2.5), what
each schedule trained and dropped, the model, and ``credit_conserved`` (the real credit accounting
balances at the end of the async run).

    python benchmarks/async_vs_sync.py [--steps 40] [--engines 4] [--sigma 1.0] ...
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from milestream.config import Config, import_path, load_config
from milestream.train.collector import PooledGroup
from milestream.infra.services import EmbeddedRedis
from milestream.schemas.codec import Position
from milestream.streams.groups import oldest_version, staleness
from milestream.streams.ledger import ADMITTED, EMITTED, BufferLedger


@dataclass(frozen=True)
class Model:
    """Everything about speed that is modelled rather than measured."""

    engines: int = 4
    max_batch: int = 64  # sequences one engine decodes together
    step_base_s: float = 0.012  # one decode step: base + per active sequence
    step_per_seq_s: float = 0.0002
    update_pause_s: float = 1.0  # engines stop while a new weight version loads
    train_base_s: float = 2.0  # one trainer step: base + per trained token
    train_per_token_s: float = 30e-6
    length_median: int = 1024  # response tokens: lognormal(log(median), sigma), at least 16, at most max
    length_sigma: float = 1.0
    length_max: int = 16384


@dataclass(frozen=True)
class SimSample:
    """What staleness reads of a trajectory: the weight versions its tokens were generated with."""

    token_versions: tuple[int, ...]


@dataclass
class Sample:
    group: "Group"
    length: int
    start_version: int


@dataclass
class Group:
    group_id: str
    size: int
    samples: list[SimSample] = field(default_factory=list)
    tokens: int = 0
    placed: int = 0


class Engine:
    """One engine under continuous batching: every active sequence advances at 1 / step_time(batch) tokens/s."""

    def __init__(self, model: Model):
        self.model = model
        self.progress = 0.0  # tokens each sequence active since the start has gained
        self.clock = 0.0
        self.paused_until = 0.0
        self.slot_seconds = 0.0  # time-integral of the batch: how full the engine was
        self.active: list[tuple[float, int, Sample]] = []  # (progress at which it ends, tie-break, sample)

    def rate(self) -> float:
        batch = len(self.active)
        return 0.0 if batch == 0 else 1.0 / (self.model.step_base_s + self.model.step_per_seq_s * batch)

    def advance(self, now: float) -> None:
        start = max(self.clock, self.paused_until)
        if now > start:
            self.progress += (now - start) * self.rate()
            self.slot_seconds += (now - start) * len(self.active)
        self.clock = max(self.clock, now)

    def next_finish(self) -> float:
        if not self.active:
            return math.inf
        start = max(self.clock, self.paused_until)
        return start + max(0.0, self.active[0][0] - self.progress) / self.rate()

    def finished(self) -> list[Sample]:
        done = []
        while self.active and self.active[0][0] <= self.progress + 1e-6:
            done.append(heapq.heappop(self.active)[2])
        return done


class Pool:
    """The engine pool: places samples on the least loaded engine with a free slot; reports finished ones."""

    def __init__(self, model: Model, lengths: np.ndarray):
        self.model = model
        self.engines = [Engine(model) for _ in range(model.engines)]
        self.lengths = iter(lengths)
        self.ticket = itertools.count()
        self.now = 0.0
        self.busy_tokens = 0.0

    def free_slots(self) -> int:
        return sum(self.model.max_batch - len(e.active) for e in self.engines)

    def place(self, group: Group, version: int) -> None:
        engine = min(self.engines, key=lambda e: len(e.active))
        sample = Sample(group, int(next(self.lengths)), version)
        group.placed += 1
        heapq.heappush(engine.active, (engine.progress + sample.length, next(self.ticket), sample))

    def next_finish(self) -> float:
        return min(e.next_finish() for e in self.engines)

    def advance(self, now: float) -> list[Sample]:
        self.now = now
        done = []
        for engine in self.engines:
            engine.advance(now)
            done += engine.finished()
        return done

    def pause(self, seconds: float) -> None:
        for engine in self.engines:
            engine.advance(self.now)
            engine.paused_until = max(engine.paused_until, self.now) + seconds


def figures(pool: Pool, tokens: int, groups: int) -> dict:
    slots = pool.model.engines * pool.model.max_batch * pool.now
    return {"tokens_s": tokens / pool.now, "groups_s": groups / pool.now, "sim_s": pool.now, "tokens_trained": tokens,
            "groups_trained": groups, "engine_batch_fill": sum(e.slot_seconds for e in pool.engines) / slots}


def train_time(model: Model, tokens: int) -> float:
    return model.train_base_s + model.train_per_token_s * tokens


def finish(sample: Sample, version: int) -> Group:
    """Record the sample in its group: its tokens carry every version from its start to now."""
    group = sample.group
    group.samples.append(SimSample(tuple(range(sample.start_version, version + 1))))
    group.tokens += sample.length
    return group


def run_sync(cfg: Config, model: Model, lengths: np.ndarray, steps: int) -> dict:
    pool, version, trained = Pool(model, lengths), 0, 0
    ids = itertools.count()
    for _ in range(steps):
        pending = [Group(f"sync-{next(ids)}", cfg.rollout.group_size) for _ in range(cfg.trainer.batch_groups)]
        queue = [g for g in pending for _ in range(g.size)]
        while queue or any(e.active for e in pool.engines):
            while queue and pool.free_slots():
                pool.place(queue.pop(), version)
            for sample in pool.advance(pool.next_finish()):
                finish(sample, version)
        tokens = sum(g.tokens for g in pending)
        pool.now += train_time(model, tokens) + model.update_pause_s  # the engines wait for both
        for engine in pool.engines:
            engine.advance(pool.now)
        version += 1
        trained += tokens
    return {**figures(pool, trained, steps * cfg.trainer.batch_groups), "groups_dropped_stale": 0, "staleness_mean": 0.0}


class AsyncRun:
    """milestream's schedule with the real credit, settlement, selector and staleness code."""

    def __init__(self, cfg: Config, model: Model, lengths: np.ndarray):
        self.cfg, self.model = cfg, model
        self.pool = Pool(model, lengths)
        self.ledger = BufferLedger(cfg)
        self.ledger.initialise()
        self.selector = import_path(cfg.buffer.selector, "buffer.selector")
        self.buffered: dict[str, PooledGroup] = {}
        self.tokens: dict[str, int] = {}  # response tokens of each buffered or training group
        self.admitting: list[Group] = []  # admitted groups with samples still to place (sample refill)
        self.in_flight = 0
        self.version = 0
        self.trainer_free_at = 0.0
        self.training: list[PooledGroup] | None = None
        self.ids, self.arrivals = itertools.count(), itertools.count()
        self.stats = {"tokens_trained": 0, "groups_trained": 0, "groups_dropped_stale": 0, "lags": []}

    def run(self, steps: int) -> dict:
        trained_steps = 0
        while trained_steps < steps:
            self._admit()
            now = min(self.pool.next_finish(), self.trainer_free_at if self.training else math.inf)
            if now == math.inf:
                raise RuntimeError("the simulation stalled: nothing generating and nothing to train")
            for sample in self.pool.advance(now):
                self._sample_done(sample)
            if self.training and now >= self.trainer_free_at:
                self._publish_version()
                trained_steps += 1
            if not self.training:
                self._start_step(now)
        lags = self.stats["lags"]
        return {**figures(self.pool, self.stats["tokens_trained"], self.stats["groups_trained"]),
                "groups_dropped_stale": self.stats["groups_dropped_stale"],
                "staleness_mean": float(np.mean(lags)) if lags else 0.0, "credit_conserved": self._conserved()}

    def _admit(self) -> None:
        while self.pool.free_slots():
            if not self.admitting:
                group_id = f"async-{next(self.ids)}"
                if self.ledger.admit(group_id, "simulation") != ADMITTED:
                    return
                self.admitting.append(Group(group_id, self.cfg.rollout.group_size))
                self.in_flight += 1
            group = self.admitting[0]
            self.pool.place(group, self.version)
            if group.placed == group.size:
                self.admitting.pop(0)

    def _sample_done(self, sample: Sample) -> None:
        group = finish(sample, self.version)
        if len(group.samples) < group.size:
            return
        self.in_flight -= 1
        self.ledger.begin_sending(group.group_id)
        self.ledger.settle(group.group_id, EMITTED, oldest_version(group.samples))
        self.buffered[group.group_id] = PooledGroup(group.group_id, group.samples, Position("sim", 0, 0),
                                                    next(self.arrivals))
        self.tokens[group.group_id] = group.tokens

    def _start_step(self, now: float) -> None:
        for pooled in list(self.buffered.values()):  # the collector's stale drop, at collection
            if staleness(pooled.samples, self.version) > self.cfg.buffer.max_staleness:
                self._leave(pooled)
                self.stats["groups_dropped_stale"] += 1
        if len(self.buffered) < self.cfg.trainer.batch_groups:
            return
        self.training = self.selector(list(self.buffered.values()), self.cfg.trainer.batch_groups)
        for pooled in self.training:
            self.stats["lags"].append(staleness(pooled.samples, self.version))
            self._leave(pooled)
        self.trainer_free_at = now + train_time(self.model, sum(self.tokens[p.group_id] for p in self.training))

    def _publish_version(self) -> None:
        self.stats["tokens_trained"] += sum(self.tokens.pop(p.group_id) for p in self.training)
        self.stats["groups_trained"] += len(self.training)
        self.training = None
        self.version += 1
        self.pool.pause(self.model.update_pause_s)

    def _leave(self, pooled: PooledGroup) -> None:
        del self.buffered[pooled.group_id]
        if pooled not in (self.training or ()):
            self.tokens.pop(pooled.group_id)
        self.ledger.leave(pooled.group_id)

    def _conserved(self) -> bool:
        return self.ledger.available() + self.ledger.queued() + self.in_flight == self.ledger.capacity


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="trainer steps of each schedule")
    parser.add_argument("--batch-groups", type=int, default=16, help="trainer.batch_groups")
    parser.add_argument("--group-size", type=int, default=8, help="rollout.group_size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="any other Config knob, e.g. buffer.capacity_factor=3 or buffer.max_staleness=4")
    for name, default in asdict(Model()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model = Model(**{name: getattr(args, name) for name in asdict(Model())})
    rng = np.random.default_rng(args.seed)
    samples_needed = 8 * args.steps * args.batch_groups * args.group_size
    lengths = np.clip(rng.lognormal(math.log(model.length_median), model.length_sigma, samples_needed),
                      16, model.length_max).astype(int)
    redis = EmbeddedRedis().start()
    try:
        cfg = load_config(None, [f"trainer.batch_groups={args.batch_groups}", f"rollout.group_size={args.group_size}",
                                 f"broker.topic_prefix=bench-async-vs-sync-{time.time_ns()}.", f"redis.url={redis.url}",
                                 *args.overrides])
        started = time.monotonic()
        sync = run_sync(cfg, model, lengths, args.steps)
        asynchronous = AsyncRun(cfg, model, lengths).run(args.steps)
        wall_s = time.monotonic() - started
    finally:
        redis.stop()
    print(json.dumps({
        "sync_tokens_s": round(sync["tokens_s"], 1), "async_tokens_s": round(asynchronous["tokens_s"], 1),
        "speedup": round(asynchronous["tokens_s"] / sync["tokens_s"], 3),
        "sync": _rounded(sync), "async": _rounded(asynchronous),
        "steps": args.steps, "batch_groups": cfg.trainer.batch_groups, "group_size": cfg.rollout.group_size,
        "buffer_capacity_groups": cfg.buffer_capacity, "max_staleness": cfg.buffer.max_staleness,
        "selector": cfg.buffer.selector, "length_p50": int(np.median(lengths)), "length_p99": int(np.quantile(lengths, 0.99)),
        "engine_speed": "modelled",
        "model": {**asdict(model), "engine": "continuous batching, one token per active sequence per decode step; "
                  "step = step_base_s + step_per_seq_s * batch; prefill not modelled",
                  "trainer": "step = train_base_s + train_per_token_s * response tokens",
                  "lengths": "lognormal(log(length_median), length_sigma) clipped to [16, length_max], same draw for both"},
        "real": ["streams.ledger.BufferLedger on redis-server", "buffer.selector "
                 + cfg.buffer.selector, "train.collector.PooledGroup", "streams.groups.staleness"],
        "wall_s": round(wall_s, 2),
    }))


def _rounded(result: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "tokens_s"}


if __name__ == "__main__":
    main()
