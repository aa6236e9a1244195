"""An inexact audit carries its evidence: each offending group's records on every topic and its decisions, each
with the stage life that wrote it (log/audit.py ``explain``), so the failure can be told once the run is gone."""
from __future__ import annotations

import time
from pathlib import Path

from emitted import emit, simple_group

from milestream.infra.kafka import RecordProducer
from milestream.log.audit import audit_run
from milestream.log.reader import BrokerSource
from milestream.schemas import topics
from milestream.schemas.records import Metrics
from milestream.streams.groups import drop_record
from milestream.train.collector import LIFE


def step(number: int, group_ids: list[str], pid: int) -> Metrics:
    return Metrics("trainer", number, time.time(), {"version": float(number), "member_pid": float(pid)}, group_ids,
                   [0] * len(group_ids))


def test_a_group_trained_and_dropped_is_explained_record_by_record(cfg):
    run_dir = Path(cfg.run.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    producer = RecordProducer(cfg.broker)
    manifests = emit(cfg, producer, simple_group("g", 0, 4) + simple_group("h", 0, 4))
    # a trainer life (pid 11) trains g in step 1, drops h as stale, and dies; the next (pid 12) redoes step 1
    # on h: the redone step is the lineage's, the dead life's drop is on the log
    producer.send(topics.METRICS, [step(1, ["g"], 11)], key="trainer")
    dropped = drop_record("h", manifests["h"], "stale", f"staleness 3 > 2{LIFE}11", "trainer", 3)
    producer.send(topics.DROPPED, [dropped], key="h")
    producer.send(topics.METRICS, [step(1, ["h"], 12)], key="trainer")
    producer.flush()

    audit = audit_run(run_dir, BrokerSource(cfg))
    assert not audit.exact and audit.groups_trained_and_dropped == ["h"] and audit.groups_buffered == 1  # g
    assert audit.offending == ["h"] and list(audit.evidence) == ["h"]
    h = audit.evidence["h"]
    assert {topic: len(at) for topic, at in h["records"].items()} == {
        "rollout.trajectories": 4, "rollout.logprobs": 4, "buffer.groups": 1, "buffer.dropped": 1, "buffer.metrics": 1}
    emitted, drop, trained = h["decisions"]
    assert (emitted["decision"], emitted["by"], emitted["life"]) == ("emitted", "processor", None)
    assert (drop["decision"], drop["by"], drop["life"], drop["reason"], drop["trainer_version"]) == \
        ("dropped", "trainer", 11, "stale", 3)
    assert (trained["decision"], trained["life"], trained["step"], trained["in_lineage"]) == ("trained", 12, 1, True)
