"""The whole loop end to end: tiny model, real broker and Redis, faust processor, separate processes;
then two of its steps replayed from the log bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest
from stage_runs import run_showing_logs

from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import BrokerSource
from milestream.log.samples import logged_samples
from milestream.observe.recompute import replay_step
from milestream.schemas import topics
from milestream.schemas.records import LogProbs, Trajectory
from milestream.streams.ledger import BufferLedger

PLUGINS = str(Path(__file__).parent / "plugins")


def read_topic(cfg, spec: topics.TopicSpec) -> list:
    consumer = RecordConsumer(cfg.broker, spec, "audit").assign(partitions=[0])
    try:
        return [r for d in consumer.drain_to_end(0) for r in d.records]
    finally:
        consumer.close()


def inject_aborted_group(cfg) -> str:
    producer = RecordProducer(cfg.broker)
    group = "injected-aborted#0"
    BufferLedger(cfg).admit(group, "test", 0)  # as a rollout worker does first: the processor takes only admitted groups
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
                              trainer={"steps": 4, "checkpoint_every": 2}, run={"max_wall_s": 240},
                              eval={"mode": "shared"})  # as in the default run


def test_whole_loop(loop_cfg):
    cfg = loop_cfg
    aborted = inject_aborted_group(cfg)
    summary = run_showing_logs(cfg)
    assert summary["steps"] == cfg.trainer.steps and summary["stopped_by"] == "steps"

    source = BrokerSource(cfg, idle_s=3.0)  # raises on a record that does not decode
    source.prefetch(topics.CATALOGUE)
    every = {spec.name: [r for m in source.messages(spec) for r in m.records] for spec in topics.CATALOGUE}
    assert every["deadletter"] == []
    lineage = archived_lineage(cfg.run.run_dir)
    trained = {gid: steps[-1] for gid, steps in lineage.training().items()}
    dropped = lineage.drops
    emitted = {}
    for sample in every["buffer.groups"]:
        emitted.setdefault(sample.group_id, []).append(sample)
    assert lineage.emitted.keys() == emitted.keys()  # the archive holds what the broker holds

    # every trained group's staleness, recomputed from its tokens (the records its manifest points at), is
    # within the bound, and the manifest says the same
    samples = logged_samples(source, set(trained))
    for gid, (step, lag) in trained.items():
        oldest = min(v for s in samples[gid] for v in s.token_versions)
        assert oldest == min(row.min_version for row in emitted[gid])
        assert lag == (step - 1) - oldest <= cfg.buffer.max_staleness
    # every group that completed (reached buffer.groups) was trained once, dropped with its reason, or is
    # still buffered; none both trained and dropped
    audit = audit_run(cfg.run.run_dir)
    assert audit.exact, audit
    assert audit.groups_emitted == audit.groups_trained + audit.groups_dropped + audit.groups_buffered
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
    # held-out evaluation (on by default): the initial weights, and the last step's version
    assert {(r.version, r.status) for r in every["eval.results"]} == {(0, "ok"), (cfg.trainer.steps, "ok")}
    assert (summary["heldout_first"]["version"], summary["heldout_last"]["version"]) == (0, cfg.trainer.steps)

    # any logged step recomputes bit for bit: step 1 from the initial weights, step 3 from the
    # checkpoint of step 2 (checkpoint_every 2)
    for step, expected_checkpoint in ((1, 0), (3, 2)):
        result = replay_step(cfg, cfg.run.run_dir, step)
        assert result.from_checkpoint == expected_checkpoint
        assert result.bitwise_equal, (result.logged, result.replayed)


def test_a_run_stopped_by_its_wall_budget_evaluates_the_version_it_ends_on(cfg, capsys):
    # no version is due but the initial one: the one the run ends on is evaluated when the stages have stopped
    cfg = cfg.with_overrides(trainer={"steps": 10_000}, run={"max_wall_s": 35},
                             eval={"mode": "shared", "every_versions": 10_000})
    summary = run_showing_logs(cfg)
    assert summary["stopped_by"] == "wall_budget"

    results = read_topic(cfg, topics.EVAL_RESULTS)
    last = summary["final_version"]  # 0 on a machine too slow to train a step within the budget: evaluated too
    assert [(r.version, r.status) for r in results] == [(0, "ok")] + ([(last, "ok")] if last else [])
    assert results[-1].lag_steps == 0
    assert summary["heldout_first"] == {"version": 0, "step": 0, "score": results[0].score}
    assert summary["heldout_last"] == {"version": last, "step": results[-1].step, "score": results[-1].score}
    assert [s["version"] for s in summary["heldout"]] == [r.version for r in results]
    printed = capsys.readouterr().out
    assert all(f"eval v{r.version} (step {r.step}, lag {r.lag_steps}): heldout {r.score:.3f}" in printed for r in results)
