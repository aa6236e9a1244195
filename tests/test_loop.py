"""The whole loop end to end: tiny model, real broker and Redis, faust processor, separate processes;
then two of its steps replayed from the log bit for bit."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from milestream.observe.recompute import replay_step
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.orchestrator import run_loop
from milestream.schemas import topics
from milestream.schemas.records import LogProbs, Trajectory

PLUGINS = str(Path(__file__).parent / "plugins")


def read_all(cfg, spec):
    """Every record on a topic; with no dead-letter producer a record that fails to decode raises."""
    partitions = range(cfg.broker.partitions) if spec.keyed_partitions else [0]
    consumer = RecordConsumer(cfg.broker, spec, f"audit-{time.time()}").assign(partitions=partitions)
    try:
        return [r for d in consumer.drain(idle_s=3.0) for r in d.records]
    finally:
        consumer.close()


def inject_aborted_group(cfg) -> str:
    producer = RecordProducer(cfg.broker)
    group = "injected-aborted#0"
    for i in range(cfg.rollout.group_size):
        status = "aborted" if i == 1 else "completed"
        producer.send(topics.TRAJECTORIES, [Trajectory(f"{group}/{i}", group, "injected-0", i, cfg.rollout.group_size,
                                                       [1, 2], [3], [1], [0], 0.0, status, "", "test", "test", 0.0, 0.0)], key=group)
        producer.send(topics.LOGPROBS, [LogProbs(f"{group}/{i}", group, i, cfg.rollout.group_size, [-1.0])], key=group)
    producer.flush()
    return group


@pytest.fixture
def loop_cfg(cfg, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PLUGINS)
    return cfg.with_overrides(buffer={"filter": "loop_filters:reject_every_third_prompt", "max_staleness": 1},
                              trainer={"steps": 4, "checkpoint_every": 2}, run={"max_wall_s": 240})


def test_whole_loop(loop_cfg):
    cfg = loop_cfg
    aborted = inject_aborted_group(cfg)
    try:
        summary = run_loop(cfg)
        assert summary["steps"] == cfg.trainer.steps and summary["stopped_by"] == "steps"
    except BaseException:
        for log in sorted((Path(cfg.run.run_dir) / "logs").glob("*.log")):
            print(f"==== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
        raise

    every = {spec.name: read_all(cfg, spec) for spec in topics.CATALOGUE}  # decodes every record
    assert every["deadletter"] == []
    steps = sorted((m for m in every["buffer.metrics"] if m.source == "trainer"), key=lambda m: m.step)
    dropped = {d.group_id: d for d in every["buffer.dropped"]}
    trained = {gid: (m.step, lag) for m in steps for gid, lag in zip(m.group_ids, m.group_staleness)}
    emitted = {}
    for sample in every["buffer.groups"]:
        emitted.setdefault(sample.group_id, []).append(sample)

    # every trained group's staleness, recomputed from its tokens, is within the bound
    for gid, (step, lag) in trained.items():
        oldest = min(v for s in emitted[gid] for v in s.token_versions)
        assert lag == (step - 1) - oldest <= cfg.buffer.max_staleness
    # every group that completed was trained, dropped with its reason, or is still buffered
    assert not trained.keys() & dropped.keys()
    assert dropped[aborted].reason == "aborted"
    for gid, d in dropped.items():
        assert d.reason in ("aborted", "filtered", "stale") and d.detail
        if d.reason == "filtered":
            assert int(gid.split("#")[0].rsplit("-", 1)[1]) % 3 == 0
    assert any(d.reason == "filtered" for d in dropped.values())
    completed = {t.group_id for t in every["rollout.trajectories"]}
    assert trained.keys() | dropped.keys() <= completed
    assert all(int(g.split("#")[0].rsplit("-", 1)[1]) % 3 for g in trained)

    # the processor published its buffer figures once per trainer step (besides its timer)
    processor_steps = {m.step for m in every["buffer.metrics"] if m.source == "processor"}
    assert set(range(1, cfg.trainer.steps)) <= processor_steps

    # the weight version advanced on the trainer and on the rollout side
    assert [v.version for v in every["weights.versions"]] == list(range(1, cfg.trainer.steps + 1))
    acks = [a for a in every["weights.applied"] if a.ok]
    assert acks and max(a.version for a in acks) >= 1
    assert max(v for t in every["rollout.trajectories"] for v in t.token_versions) >= 1
    assert summary["final_version"] == cfg.trainer.steps
    assert (Path(cfg.run.run_dir) / "summary.json").exists()
    assert (Path(cfg.run.run_dir) / "reward_staleness.png").stat().st_size > 0

    # any logged step recomputes bit for bit: step 1 from the initial weights, step 3 from the
    # checkpoint of step 2 (checkpoint_every 2)
    for step, expected_checkpoint in ((1, 0), (3, 2)):
        result = replay_step(cfg, cfg.run.run_dir, step)
        assert result.from_checkpoint == expected_checkpoint
        assert result.bitwise_equal, (result.logged, result.replayed)

