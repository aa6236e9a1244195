"""What every metrics consumer reads: the records of the run's observable topics, live or archived.

A metrics consumer is an ``Observer`` fed ``Observed`` records, one at a time, from either source:

- ``TopicFeed``: the live topics, every partition from the beginning (assigned, never committing, so
  any number of observers can come and go without touching the loop or each other), or from the
  position a resuming reader committed itself (the experiment trackers, observe/track.py);
- ``archived``: the same topics from ``RUN_DIR/archive`` (read by log/reader.py), no broker needed.

A command that reads a run's live topics asks ``live_topics`` first: when no broker answers (the run is
over, its embedded broker gone) it reads the archive instead, or says which command does (``RunOver``).

A value that does not decode is logged with its topic, partition, offset and field, skipped and
counted (``log.reader.SkipBadRecords``): an observer of the loop must not stop on a record the
processor has already dead-lettered.
"""
from __future__ import annotations

import heapq
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Protocol

from milestream.config import Config, RunFolderError, UserError
from milestream.infra.kafka import Admin, Check, RecordConsumer, RecordProducer, answers, end_offset, topic_name
from milestream.log.archive import archive_dir, load_manifest
from milestream.log.reader import OnBadRecord, SkipBadRecords, read_archive
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Record

# every figure of the loop lives on one of these: stage metrics, drops, weight versions, weight acks, evaluations
FEED_TOPICS: tuple[topics.TopicSpec, ...] = (
    topics.METRICS, topics.DROPPED, topics.WEIGHT_VERSIONS, topics.WEIGHTS_APPLIED, topics.EVAL_RESULTS)


@dataclass(frozen=True)
class Observed:
    spec: topics.TopicSpec
    position: Position
    record: Record


class Observer(Protocol):
    def observe(self, item: Observed) -> None: ...


class TopicFeed:
    """The live topics, read from their beginning by one assigned consumer per topic."""

    def __init__(self, cfg: Config, group_id: str, specs: Iterable[topics.TopicSpec] = FEED_TOPICS,
                 on_bad: OnBadRecord | None = None, deadletter: RecordProducer | None = None,
                 check: Check | None = None, start: Mapping[tuple[str, int], int] | None = None,
                 tail: Mapping[str, int] | None = None):
        """``deadletter``, ``check``: a feed the run relies on (the run monitor) dead-letters what does not
        decode or breaks ``check``, instead of handing it to ``on_bad``. ``start``: the next offset to read
        per (topic, partition) of a reader resuming from its committed position (else the beginning).
        ``tail``: per topic, read only about the last N records of each partition (the live page's trajectories)."""
        start, tail = start or {}, tail or {}
        self.on_bad = on_bad or SkipBadRecords()
        if not cfg.broker.bootstrap_servers:
            raise ValueError("no broker to read from: give --bootstrap-servers, or the --run-dir of a run "
                             "(its config.yaml names the broker)")
        admin = Admin(cfg.broker)
        self.consumers: list[RecordConsumer] = []
        for spec in specs:
            try:
                partitions = admin.partitions(spec)
            except KeyError:
                raise RuntimeError(f"topic {topic_name(cfg.broker, spec)!r} does not exist on "
                                   f"{cfg.broker.bootstrap_servers}: is broker.topic_prefix the run's?") from None
            # observers tolerate half a second of lag; the loop's short fetch wait would have the broker
            # answer tens of empty fetches a second per consumer, CPU the loop's own stages want
            consumer = RecordConsumer(cfg.broker, spec, group_id, deadletter=deadletter, check=check,
                                      **{"fetch.wait.max.ms": "500"})
            offsets = {p: start[spec.name, p] for p in partitions if (spec.name, p) in start}
            if spec.name in tail:
                offsets = {p: max(0, end_offset(consumer, p) - tail[spec.name]) for p in partitions}
            self.consumers.append(consumer.assign(offsets, partitions))

    def poll(self, timeout: float, limit: int = 1000) -> list[Observed]:
        """What arrived on any topic within about ``timeout`` (at most ``limit`` deliveries per topic)."""
        out: list[Observed] = []
        for consumer in self.consumers:
            wait = timeout / len(self.consumers)
            for _ in range(limit):
                try:
                    delivery = consumer.poll(wait)
                except RecordError as exc:
                    self.on_bad(exc)
                    continue
                if delivery is None:
                    break
                wait = 0.0  # take what is already fetched, then go on to the next topic
                out.extend(Observed(consumer.spec, delivery.position, r) for r in delivery.records)
        return out

    def drain(self, idle_s: float = 2.0, max_wait_s: float = 60.0) -> list[Observed]:
        """Everything up to the end offsets the broker reports at the call, then until no topic has delivered
        for ``idle_s``. Quiet alone is no end: a feed started a moment ago has fetched nothing yet."""
        ends = [(consumer, consumer.ends()) for consumer in self.consumers]
        out: list[Observed] = []
        started = quiet = time.monotonic()
        while time.monotonic() - started < max_wait_s:
            got = self.poll(0.2)
            if got:
                out.extend(got)
                quiet = time.monotonic()
            elif time.monotonic() - quiet >= idle_s and all(c.reached(e) for c, e in ends):
                break
        return out

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()


def archived(run_dir: str | Path, specs: Iterable[topics.TopicSpec] = FEED_TOPICS,
             on_bad: OnBadRecord | None = None, start: Mapping[tuple[str, int], int] | None = None
             ) -> Iterator[Observed]:
    """The archived records of ``specs`` (from ``start``, as for ``TopicFeed``) as a live feed would have
    delivered them: each partition in offset order, the partitions merged by broker timestamp, so an observer
    that keeps figures across topics (drops so far at a trainer step) sees them as it would have live."""
    load_manifest(run_dir)  # a clear error when the folder holds no archive
    on_bad, start = on_bad or SkipBadRecords(), start or {}
    partitions: dict[tuple[str, int], list[tuple[int, Observed]]] = {}
    for spec in specs:
        for message in read_archive(run_dir, spec, on_bad):
            if message.offset >= start.get((spec.name, message.partition), 0):
                partitions.setdefault((spec.name, message.partition), []).extend(
                    (message.timestamp_ms, Observed(spec, message.position, record)) for record in message.records)
    for _, item in heapq.merge(*partitions.values(), key=lambda timed: timed[0]):
        yield item


def follow(feed: TopicFeed, observers: Iterable[Observer], stop: threading.Event, poll_s: float = 0.5) -> None:
    """Feed every observer each record as it arrives, until ``stop`` is set."""
    observers = list(observers)
    while not stop.is_set():
        for item in feed.poll(poll_s):
            for observer in observers:
                observer.observe(item)


class RunOver(UserError):
    """A command that follows a live run, given a run no broker serves any more."""


def live_topics(cfg: Config) -> bool:
    """Whether a broker answers at ``broker.bootstrap_servers`` (quickly, and without librdkafka's log of
    refused connections): the run's topics are live. False: read ``archived(cfg.run_path)`` instead."""
    return bool(cfg.broker.bootstrap_servers) and answers(cfg.broker)


def _no_broker(cfg: Config) -> str:
    return (f"no broker answers at {cfg.broker.bootstrap_servers}" if cfg.broker.bootstrap_servers
            else "no broker named (--bootstrap-servers, or the --run-dir of a run)")


def archive_instead(cfg: Config) -> str:
    """The line saying that the run's topics are gone and its archive is read instead; RunFolderError when
    its folder holds no archive either."""
    try:
        load_manifest(cfg.run_path)
    except RunFolderError as exc:
        raise RunFolderError(f"{_no_broker(cfg)}, and no archive to read instead: {exc}") from None
    return f"{_no_broker(cfg)}: the run in {cfg.run.run_dir} is over; reading its archive {archive_dir(cfg.run_path)}"


def run_over(cfg: Config) -> RunOver:
    """For a command that only follows a live run (a server, a log writer): what reads the finished one."""
    archive_instead(cfg)  # RunFolderError when there is nothing to read either
    run_dir = cfg.run.run_dir
    return RunOver(f"{_no_broker(cfg)}: the run in {run_dir} is over. `milestream metrics --run-dir {run_dir}` "
                   f"prints its last figures from its archive; `milestream plot --run-dir {run_dir}` and "
                   f"`milestream track --from-archive {run_dir}` read it too")
