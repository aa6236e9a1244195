"""A group the trainer dropped stays dropped across trainer lives (issue 27: trained and also on buffer.dropped).

The window: a trainer life drops a group as stale after its last checkpoint and is SIGKILLed before the next.
The next life resumes from that checkpoint, at an older version, re-reads the group, to which the group is
fresh, and would train it; the audit then finds the group trained (the redone step's record is the lineage's)
and dropped (the dead life's drop is on the log). Held by construction: the trainer is held as it collects
step 2; the stale group, emitted then, is alone in its pool as it collects step 3 and is dropped; the group
it takes is emitted only once that drop is on the log; the trainer is SIGKILLed held after publishing step 3.
The selector takes groups by id, so the next life takes the stale group as soon as it has read it (standing in
for whatever order it reads the partitions of buffer.groups in).
"""
from __future__ import annotations

import time
from pathlib import Path

from emitted import emit, simple_group

from holds import Holds
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.secret_env import stage_environment
from milestream.log.audit import audit_run, explain
from milestream.log.reader import BrokerSource
from milestream.orchestrator import Child
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger, TrainerDrop

PLUGINS = str(Path(__file__).parents[1] / "plugins")
STALE = "a-stale"  # sorts first: a life that has it fresh in its pool takes it first


def trainer_stage(cfg, run_dir: Path) -> Child:
    """``milestream train`` as its own OS process, on the run folder's config.yaml; every life appends to one log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return Child("trainer", ["train"], run_dir / "config.yaml", run_dir, stage_environment(cfg))


def alive(trainer: Child) -> None:
    if trainer.proc.poll() is not None:
        raise AssertionError(f"the trainer exited with {trainer.proc.returncode}:\n{trainer.tail(60)}")


def emit_groups(cfg, versions: dict[str, int]) -> None:
    """The groups on buffer.groups, as the processor emits them (their tokens of these versions)."""
    producer = RecordProducer(cfg.broker)
    emit(cfg, producer, [r for gid, version in versions.items() for r in simple_group(gid, version, 4)])


def drops_on_the_log(cfg) -> list:
    reader = RecordConsumer(cfg.broker, topics.DROPPED, "test").assign(partitions=range(cfg.broker.partitions))
    try:
        return [d for delivery in reader.drain() for d in delivery.records]
    finally:
        reader.close()


def wait_dropped(cfg, group_id: str, trainer: Child, timeout_s: float = 300) -> None:
    """Until a drop of the group is on buffer.dropped (the deadline: a hang guard)."""
    reader = RecordConsumer(cfg.broker, topics.DROPPED, "wait").assign(partitions=range(cfg.broker.partitions))
    deadline = time.monotonic() + timeout_s
    try:
        while not ((delivery := reader.poll(0.5)) and delivery.records[0].group_id == group_id):
            alive(trainer)
            assert time.monotonic() < deadline, f"no drop of {group_id} after {timeout_s:.0f}s"
    finally:
        reader.close()


def test_a_group_a_killed_trainer_dropped_is_not_trained_by_the_next_life(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(buffer={"max_staleness": 1, "selector": "pool_selectors:by_group_id"},
                             trainer={"batch_groups": 1, "steps": 4, "checkpoint_every": 10})
    monkeypatch.setenv("PYTHONPATH", PLUGINS)  # the trainer imports the selector from there
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected", at_pass=2)  # step 2's batch taken (b-2), the trainer at version 1
    holds.arm("trainer.published", at_pass=3)  # step 3 published (its collection dropped the stale group)
    run_dir = Path(cfg.run.run_dir)
    emit_groups(cfg, {"b-1": 0, "b-2": 0})
    trainer = trainer_stage(cfg, run_dir)
    try:
        held = holds.wait_held("trainer.collected", 300, lambda: alive(trainer))
        emit_groups(cfg, {STALE: 0})  # as it collects step 3, at version 2, the group lags 2 > 1
        holds.release("trainer.collected", held)
        wait_dropped(cfg, STALE, trainer)
        emit_groups(cfg, {"b-3": 2, "b-4": 2})
        held = holds.wait_held("trainer.published", 300, lambda: alive(trainer))
        lives = [trainer.proc.pid]
        trainer.proc.kill()  # before any checkpoint (every 10 steps): the next life starts over at version 0
        trainer.proc.wait()
        holds.release("trainer.published", held)
        assert BufferLedger(cfg).sent([STALE])[1] == {STALE: TrainerDrop("stale", 2)}
        trainer.start()
        lives.append(trainer.proc.pid)
        assert trainer.proc.wait(timeout=300) == 0, trainer.tail(60)  # the timeout: a hang guard
    except BaseException:
        print(trainer.tail(60))
        raise

    audit = audit_run(run_dir, BrokerSource(cfg))
    assert audit.exact, audit
    assert (audit.steps, audit.step_records, audit.groups_trained, audit.groups_dropped) == (4, 7, 4, 1), audit
    drops = drops_on_the_log(cfg)  # the dead life's, then the next life's as it decided
    assert [(d.group_id, d.reason, d.trainer_version) for d in drops] == [(STALE, "stale", 2)] * 2, drops
    assert drops[1].detail.startswith("stale, as an earlier life of the trainer decided")
    decisions = explain(BrokerSource(cfg), [STALE])[STALE]["decisions"]  # what an inexact audit would print
    assert [(d["decision"], d["by"], d["life"]) for d in decisions] == \
        [("emitted", "processor", None), ("dropped", "trainer", lives[0]), ("dropped", "trainer", lives[1])]
