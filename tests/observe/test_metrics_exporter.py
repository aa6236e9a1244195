"""The metrics stage as `milestream run` starts it (`milestream metrics --serve --jsonl`): its Prometheus
endpoint scraped over HTTP and parsed, with series from every source, after real records on the broker."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from metrics_records import METRICS_RECORDS, publish_run
from prometheus_client.parser import text_string_to_metric_families

from milestream.infra.services import free_port, terminate

Series = dict[tuple[str, frozenset], float]


def scrape(port: int) -> tuple[Series, dict[str, str]]:
    """Every sample as (name, labels) -> value, and every family's type."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = list(text_string_to_metric_families(text))
    samples = {(s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples}
    return samples, {family.name: family.type for family in families}


def labels(**pairs: str) -> frozenset:
    return frozenset(pairs.items())


WANTED: Series = {
    ("milestream_trainer_reward_mean", labels()): 0.4,
    ("milestream_trainer_step", labels()): 4.0,
    ("milestream_trainer_step_s", labels()): 10.0,
    ("milestream_trainer_trained_tokens_total", labels()): 4 * 32 * 10.0,  # step 2's redo counted once
    ("milestream_processor_queue_size", labels()): 3.0,
    ("milestream_processor_latest_version", labels()): 2.0,
    ("milestream_rollout_samples_per_s", labels(id="worker-0")): 3.2,
    ("milestream_rollout_engine_version", labels(id="worker-0")): 2.0,
    ("milestream_verifier_weights_mismatched", labels()): 1.0,
    ("milestream_buffer_dropped_total", labels(reason="stale", dropped_by="processor")): 2.0,  # g1 resent: once
    ("milestream_buffer_dropped_total", labels(reason="filtered", dropped_by="processor")): 1.0,
    ("milestream_weights_versions_published_total", labels()): 2.0,
    ("milestream_weights_version", labels(transport="disk")): 2.0,
    ("milestream_weights_applied_total", labels(engine="worker-0", ok="true")): 2.0,
    ("milestream_weights_applied_total", labels(engine="worker-1", ok="false")): 1.0,
    ("milestream_weights_engine_version", labels(engine="worker-0")): 2.0,
    ("milestream_weights_sync_seconds_count", labels(engine="worker-0")): 2.0,
    ("milestream_weights_sync_seconds_sum", labels(engine="worker-0")): 1.0,
}


def test_metrics_stage_serves_every_source_and_logs_jsonl(cfg, tmp_path):
    publish_run(cfg)
    port, jsonl = free_port(), tmp_path / "metrics.jsonl"
    stage = subprocess.Popen(
        [sys.executable, "-m", "milestream.cli", "metrics", "--serve", "--prometheus-port", str(port),
         "--jsonl", str(jsonl), "--bootstrap-servers", cfg.broker.bootstrap_servers,
         "--set", f"broker.topic_prefix={cfg.broker.topic_prefix}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, samples = time.monotonic() + 60, {}
        while time.monotonic() < deadline and stage.poll() is None:
            try:
                samples, types = scrape(port)
            except OSError:  # not listening yet
                pass
            if all(abs(samples.get(key, float("nan")) - value) < 1e-9 for key, value in WANTED.items()):
                break
            time.sleep(0.3)
        assert {key: samples.get(key) for key in WANTED} == WANTED
        assert types["milestream_buffer_dropped"] == "counter"
        assert types["milestream_weights_sync_seconds"] == "summary"
        assert types["milestream_trainer_reward_mean"] == "gauge"
    finally:
        terminate(stage, grace=20)
    output = stage.stdout.read()
    assert stage.returncode == 0, output
    # the value on buffer.metrics that is not Arrow was skipped, named by topic, offset and field
    assert f"{cfg.broker.topic_prefix}buffer.metrics[0]@{METRICS_RECORDS}: field '<value>'" in output
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [line["offset"] for line in lines] == list(range(METRICS_RECORDS))
    assert {line["source"] for line in lines} == {"trainer", "processor", "rollout/worker-0", "verifier"}
