"""A Prometheus endpoint for every figure on ``buffer.metrics``, built from the topic alone.

Each value a stage publishes becomes the gauge ``milestream_<name>{source="<stage>"}`` (the trainer,
the processor, each rollout worker), plus ``milestream_step{source=...}``. Being a plain consumer of
the topic, it can be started, restarted or run on another machine without touching the loop.
"""
from __future__ import annotations

import logging
import re
import threading

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from milestream.config import Config
from milestream.infra.kafka import RecordConsumer
from milestream.schemas import topics
from milestream.schemas.records import Metrics

log = logging.getLogger(__name__)
_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(name: str) -> str:
    return "milestream_" + _INVALID.sub("_", name)


class PrometheusExporter:
    def __init__(self, cfg: Config, port: int, group_id: str = "prometheus-exporter"):
        self.registry = CollectorRegistry()
        self.gauges: dict[str, Gauge] = {}
        self.consumer = RecordConsumer(cfg.broker, topics.METRICS, group_id).assign(partitions=[0])
        self.server, self.thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.port = self.server.server_port

    def observe(self, record: Metrics) -> None:
        for name, value in {"step": float(record.step), **record.values}.items():
            gauge = self.gauges.get(name)
            if gauge is None:
                gauge = Gauge(metric_name(name), f"{name} as published on buffer.metrics", ["source"],
                              registry=self.registry)
                self.gauges[name] = gauge
            gauge.labels(source=record.source).set(value)

    def run(self, stop: threading.Event) -> None:
        log.info("Prometheus metrics on http://127.0.0.1:%d/metrics", self.port)
        while not stop.is_set():
            delivery = self.consumer.poll(0.5)
            for record in delivery.records if delivery else []:
                self.observe(record)
        self.close()

    def close(self) -> None:
        self.consumer.close()
        self.server.shutdown()
