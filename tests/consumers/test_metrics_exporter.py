"""The Prometheus endpoint, scraped over HTTP and parsed, fed by real records on buffer.metrics."""
from __future__ import annotations

import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from milestream.consumers.metrics_exporter import PrometheusExporter
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import Metrics


def scrape(port: int) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, s.labels.get("source", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_published_figure_is_scraped(cfg):
    producer = RecordProducer(cfg.broker)
    producer.send(topics.METRICS, [Metrics("trainer", 7, time.time(), {"reward_mean": 0.25, "staleness_max": 2.0})])
    producer.send(topics.METRICS, [Metrics("processor", 3, time.time(), {"queue_size": 5.0, "dropped_stale": 1.0})])
    producer.flush()
    exporter = PrometheusExporter(cfg, port=0)
    stop = threading.Event()
    thread = threading.Thread(target=exporter.run, args=(stop,))
    thread.start()
    try:
        wanted = {("milestream_reward_mean", "trainer"): 0.25, ("milestream_staleness_max", "trainer"): 2.0,
                  ("milestream_step", "trainer"): 7.0, ("milestream_queue_size", "processor"): 5.0,
                  ("milestream_dropped_stale", "processor"): 1.0}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not wanted.items() <= scrape(exporter.port).items():
            time.sleep(0.2)
        assert wanted.items() <= scrape(exporter.port).items()
    finally:
        stop.set()
        thread.join()
