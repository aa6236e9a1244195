"""A small run's worth of real records from every stage, published on the test broker, for the metrics tests."""
from __future__ import annotations

import time

from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import Dropped, Metrics, WeightApplied, WeightVersion

STEPS = 4
TRAINER_METRICS = STEPS + 1  # step 2 is published twice
METRICS_RECORDS = TRAINER_METRICS + 3 + 1 + 1  # + processor, rollout, verifier
DROPS = {"stale": 2, "filtered": 1}


def trainer_step(step: int, ts: float) -> Metrics:
    values = {"reward_mean": 0.1 * step, "loss": -0.01 * step, "step_s": 10.0, "version": float(step),
              "staleness_mean": 1.5, "staleness_max": 2.0, "queue_size": float(step % 3), "samples": 32.0,
              "response_len_mean": 10.0, "grad_norm": 0.5}
    return Metrics("trainer", step, ts, values, [f"g{step}-{i}" for i in range(4)], [1, 2, 1, 2])


def publish_run(cfg, bad_value: bool = True) -> float:
    """Trainer steps, processor and rollout figures, a verifier's count, drops (one resent), two weight
    versions and their acks; with ``bad_value`` also a value on buffer.metrics that is not Arrow.
    Returns the first record's timestamp."""
    t0 = time.time() - 100
    producer = RecordProducer(cfg.broker, client_id="metrics-test")
    for step, ts in [(1, 10), (2, 20), (2, 22), (3, 30), (4, 40)]:  # a restarted trainer redid step 2
        producer.send(topics.METRICS, [trainer_step(step, t0 + ts)], key="trainer")
    for i in range(3):
        producer.send(topics.METRICS, [Metrics("processor", 2, t0 + 10 * i + 5, {
            "queue_size": float(i + 1), "partial_groups": 1.0, "credit_available": 3.0, "latest_version": 2.0})],
            key="processor")
    producer.send(topics.METRICS, [Metrics("rollout/worker-0", 30, t0 + 30, {
        "samples": 96.0, "samples_per_s": 3.2, "inflight": 8.0, "engine_version": 2.0})], key="rollout/worker-0")
    producer.send(topics.METRICS, [Metrics("verifier", 3, t0 + 31, {"weights_verified": 2.0,
                                                                   "weights_mismatched": 1.0})], key="verifier")
    if bad_value:
        producer.send_raw(topics.METRICS, b"not an arrow stream", key="trainer")
    for i, (group, reason) in enumerate([("g1", "stale"), ("g2", "filtered"), ("g3", "stale"), ("g1", "stale")]):
        producer.send(topics.DROPPED, [Dropped(group, group, reason, "", "processor", 4, 0, 2, 0.0, t0 + 12 + i)],
                      key=group)
    for version in (1, 2):
        producer.send(topics.WEIGHT_VERSIONS, [WeightVersion(version, version, -1, "disk", f"/w/{version}",
                                                             ["w"], ["00"], 1000, t0 + 10 * version)])
        producer.send(topics.WEIGHTS_APPLIED, [WeightApplied("worker-0", version, ["w"], ["00"], True, "",
                                                             t0 + 10 * version + 0.5)], key="worker-0")
    producer.send(topics.WEIGHTS_APPLIED, [WeightApplied("worker-1", 2, [], [], False, "checksum differs",
                                                         t0 + 21)], key="worker-1")
    producer.flush()
    return t0
