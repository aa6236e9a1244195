"""One Prometheus endpoint with every figure of the run, built from the topics alone.

Series (all prefixed ``milestream_``; a source ``kind/id`` puts ``id`` in a label):

- ``<kind>_<name>{id}``: gauge of each value a stage publishes on ``buffer.metrics`` (kinds
  ``trainer``, ``processor``, ``rollout`` with ``id="worker-0"``, ``verifier``), plus
  ``<kind>_step`` and ``<kind>_timestamp_seconds`` of its latest record;
- ``trainer_trained_tokens_total``: response tokens trained (``rate()`` gives tokens/s);
- ``buffer_dropped_total{reason,dropped_by}``: groups on ``buffer.dropped``, each group id once;
- ``weights_versions_published_total``, ``weights_version{transport}``, ``weights_version_bytes``:
  from ``weights.versions``;
- ``weights_applied_total{engine,ok}``, ``weights_engine_version{engine}``,
  ``weights_sync_seconds{engine}`` (summary: publication -> the engine's ack on ``weights.applied``).

Verify mismatches are the verifier's ``verifier_weights_mismatched``. Being a plain consumer of the
topics, the endpoint can be started, restarted or run on another machine without touching the loop. The
same server serves the live run page at ``/`` (observe/page.py).
"""
from __future__ import annotations

import collections
import logging
import re
import threading
from pathlib import Path
from typing import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from milestream.config import Config
from milestream.observe.feed import FEED_TOPICS, Observed, TopicFeed, follow, live_topics, run_over
from milestream.observe.jsonl import JsonlWriter
from milestream.observe.page import RunPage, page_routes, serve_http
from milestream.observe.series import RunSeries
from milestream.schemas import topics

log = logging.getLogger(__name__)
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def series_name(*parts: str) -> str:
    return "_".join(["milestream", *(_INVALID.sub("_", part) for part in parts)])


class Families:
    """Metric families under construction; a name is one family of one type."""

    def __init__(self) -> None:
        self.families: dict[str, Metric] = {}

    def add(self, kind: str, name: str, doc: str, labels: dict[str, str], value: float, suffix: str = "") -> None:
        family = self.families.setdefault(name, Metric(name, doc, kind))
        if family.type != kind:
            log.warning("series %s is already a %s; dropping its %s sample", name, family.type, kind)
            return
        family.add_sample(name + suffix, labels, value)

    def gauge(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        self.add("gauge", name, doc, labels, value)

    def counter(self, name: str, doc: str, labels: dict[str, str], value: float) -> None:
        self.add("counter", name, doc, labels, value, "_total")

    def summary(self, name: str, doc: str, labels: dict[str, str], values: list[float]) -> None:
        self.add("summary", name, doc, labels, len(values), "_count")
        self.add("summary", name, doc, labels, sum(values), "_sum")


def stage_series(series: RunSeries, out: Families) -> None:
    for source, record in sorted(series.latest.items()):
        kind, _, ident = source.partition("/")
        labels = {"id": ident} if ident else {}
        for name, value in {"step": float(record.step), **record.values}.items():
            out.gauge(series_name(kind, name), f"{name} as {kind} publishes it on buffer.metrics", labels, value)
        out.gauge(series_name(kind, "timestamp_seconds"), f"when {kind} published its latest figures", labels,
                  record.ts)
    out.counter(series_name("trainer", "trained_tokens"), "response tokens trained (samples x mean length per step)",
                {}, series.tokens_trained())
    for (reason, dropped_by), count in sorted(series.drops_by("reason", "dropped_by").items()):
        out.counter(series_name("buffer", "dropped"), "groups dropped (buffer.dropped, each group once)",
                    {"reason": reason, "dropped_by": dropped_by}, count)


def weight_series(series: RunSeries, out: Families) -> None:
    out.counter(series_name("weights", "versions_published"), "weight versions announced on weights.versions", {},
                len(series.versions))
    latest = series.latest_version()
    if latest is not None:
        out.gauge(series_name("weights", "version"), "newest weight version announced",
                  {"transport": latest.transport}, latest.version)
        out.gauge(series_name("weights", "version_bytes"), "bytes of the newest version's payload", {},
                  latest.num_bytes)
    acks = collections.Counter((a.engine_id, str(a.ok).lower()) for a in series.acks)
    for (engine, ok), count in sorted(acks.items()):
        out.counter(series_name("weights", "applied"), "acks on weights.applied", {"engine": engine, "ok": ok}, count)
    for engine, version in sorted(series.engine_versions().items()):
        out.gauge(series_name("weights", "engine_version"), "newest version the engine holds", {"engine": engine},
                  version)
    synced: dict[str, list[float]] = collections.defaultdict(list)
    for engine, _, seconds in series.sync_seconds():
        synced[engine].append(seconds)
    for engine, seconds in sorted(synced.items()):
        out.summary(series_name("weights", "sync_seconds"), "from a version's publication to the engine's ack",
                    {"engine": engine}, seconds)


def families(series: RunSeries) -> Iterable[Metric]:
    out = Families()
    stage_series(series, out)
    weight_series(series, out)
    return list(out.families.values())


class PrometheusExporter:
    """An observer of the feed and a Prometheus collector over what it observed."""

    def __init__(self) -> None:
        self.series = RunSeries()
        self.lock = threading.Lock()  # the feed's thread observes while the server's threads scrape
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def observe(self, item: Observed) -> None:
        with self.lock:
            self.series.observe(item)

    def collect(self) -> Iterable[Metric]:
        with self.lock:
            return families(self.series)


def serve(cfg: Config, stop: threading.Event, port: int | None, addr: str = "127.0.0.1",
          jsonl: str | Path | None = None) -> None:
    """The headless metrics stage until ``stop``: on a port, the live run page and the Prometheus endpoint
    (observe/page.py); the JSONL log (a path); or both. RunOver at once for a run no broker serves any more."""
    if not live_topics(cfg):
        raise run_over(cfg)
    observers: list[PrometheusExporter | JsonlWriter | RunPage] = []
    server = None
    if port is not None:
        exporter, page = PrometheusExporter(), RunPage(cfg)
        observers += [exporter, page]
        server = serve_http(port, addr, {**page_routes(page), "/metrics": lambda: (
            CONTENT_TYPE_LATEST, generate_latest(exporter.registry))})
        url = f"http://{addr}:{server.server_port}"
        print(f"serving {url}/metrics and the live page {url}/", flush=True)
    if jsonl:
        observers.append(JsonlWriter(jsonl))
    shown = cfg.observe.page_trajectories if port is not None else 0
    tail = {topics.TRAJECTORIES.name: shown} if shown else {}
    feed = TopicFeed(cfg, f"{cfg.broker.topic_prefix}metrics-stage",
                     specs=FEED_TOPICS + ((topics.TRAJECTORIES,) if tail else ()), tail=tail)
    try:
        follow(feed, observers, stop)
    finally:
        feed.close()
        if server is not None:
            server.shutdown()
        for observer in observers:
            if isinstance(observer, JsonlWriter):
                observer.close()
