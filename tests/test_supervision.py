"""``milestream run`` under crashes: the stream processor SIGKILLed at several points while the whole
loop runs, then the embedded broker SIGKILLed (not a planned stop: the archive may miss its last
records); in another run the trainer SIGKILLed ten times, each time held at a named point of a step
(milestream/infra/faults.py); in a third the embedded Redis SIGKILLed, its buffer ledger rebuilt from
the log. The run supervises them all, finishes its steps, and its log shows every group that entered
trained or dropped exactly once (after de-duplication by group id), or still waiting in the buffer.
Holds, not timing, keep each run going until its last crash.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from milestream.config import load_config
from milestream.infra.redis_client import redis_client
from milestream.orchestrator import SIDE_STAGE_WAIT_S
from milestream_testkit.chaos import broker_pids, redis_pids, sigkill, stage_pids
from stage_runs import print_logs_unless_done, running, start_run, wait_for
from holds import Holds
from milestream.train import checkpoint
from milestream.log.archive import ArchiveState
from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import read_archive
from milestream.log.restore import covered_checkpoints
from milestream.infra.kafka import RecordConsumer
from milestream.schemas import topics
from milestream.streams.processor import app_id

PROCESSOR_KILLS_AT_GROUPS = (2, 5, 8)  # SIGKILL the processor once this many groups have been emitted


def life_starts(stage_log: Path) -> list[float]:
    """When each life of a stage began (its log's ``==== life N`` lines, whole seconds)."""
    return [time.mktime(time.strptime(line.split(" ", 3)[3], "%Y-%m-%d %H:%M:%S"))
            for line in stage_log.read_text(errors="replace").splitlines() if line.startswith("==== life ")]


class EmittedGroups:
    """The group ids on buffer.groups so far, read as they come."""

    def __init__(self, cfg):
        self.reader = RecordConsumer(cfg.broker, topics.GROUPS, f"audit-{time.time()}").assign(
            partitions=range(cfg.broker.partitions))
        self.ids: set[str] = set()

    def count(self) -> int:
        self.ids.update(d.records[0].group_id for d in self.reader.drain(idle_s=0.2, max_wait_s=5.0))
        return len(self.ids)


def test_run_survives_processor_kills_and_a_broker_crash(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(broker={"bootstrap_servers": None},  # its own embedded broker, to crash
                             trainer={"steps": 8, "checkpoint_every": 1},
                             buffer={"incomplete_after_s": 20.0},
                             run={"max_wall_s": 400, "max_restarts": 5})
    run_dir = Path(cfg.run.run_dir)
    # the trainer holds as it collects step 4's batch, three checkpoints written: the run cannot end
    # before the processor kills (the 8th group emitted is one it collects) and the broker crash
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected", at_pass=4)
    runner, outcome = start_run(cfg)
    config_path = run_dir / "config.yaml"
    try:
        # the stages start once their configuration is written whole: read it then, not when it appears
        wait_for(lambda: stage_pids(config_path, "process"), 120, "the run's stages", runner)
        live = load_config(config_path)
        emitted_so_far = EmittedGroups(live)
        for groups in PROCESSOR_KILLS_AT_GROUPS:
            wait_for(lambda: emitted_so_far.count() >= groups and stage_pids(config_path, "process"), 300,
                     f"{groups} groups emitted", runner)
            victim = stage_pids(config_path, "process")[0]
            sigkill(victim)
            wait_for(lambda: [p for p in stage_pids(config_path, "process") if p != victim], 60,
                     "the processor started again", runner)
        trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer held at step 4"))
        assert checkpoint.latest_step(run_dir) >= 3
        emitted_so_far.reader.close()
        sigkill(broker_pids(live)[0])
        holds.release("trainer.collected", trainer)  # it meets the lost broker, as a running step would
        runner.join(600)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["steps"] == cfg.trainer.steps

    processor_log = (run_dir / "logs" / "processor.log").read_text()
    # three kills restarted by supervision, then one more life after the broker came back
    assert processor_log.count("==== life") >= len(PROCESSOR_KILLS_AT_GROUPS) + 2
    # after the crash the verifier (off the path to a step) waited for the first step, or SIDE_STAGE_WAIT_S
    trainer_back = life_starts(run_dir / "logs" / "trainer.log")[-1]
    first_step_back = min(m.ts for m in archived_lineage(run_dir).steps.values() if m.ts >= trainer_back)
    verifier_back = life_starts(run_dir / "logs" / "verifier.log")[1]
    assert verifier_back >= min(first_step_back, trainer_back + SIDE_STAGE_WAIT_S) - 1  # whole seconds in the logs

    # the durable log of the whole run, both brokers, as the archive holds it
    lineage = archived_lineage(run_dir)  # a resumed trainer redoes the steps after its checkpoint
    assert sorted(lineage.steps) == list(range(1, cfg.trainer.steps + 1))
    assert not lineage.trained_twice(), "a group trained twice"
    assert not lineage.trained_and_dropped()
    trained, emitted = lineage.training(), lineage.emitted.keys()
    dropped = {g: d.reason for g, d in lineage.drops.items()}
    samples = collections.defaultdict(set)  # a prompt admitted again after the crash is generated again
    # where the processor stopped reading: a group the worker finished while the stages stopped waits there
    read_up_to = ArchiveState.load(run_dir).groups[app_id(live)][topics.TRAJECTORIES.name]
    unread = set()
    for message in read_archive(run_dir, topics.TRAJECTORIES):
        for t in message.records:
            samples[t.group_id].add(t.sample_index)
            if message.offset >= read_up_to.get(message.partition, 0):
                unread.add(t.group_id)
    complete = {g for g, indices in samples.items() if len(indices) == cfg.rollout.group_size}
    # every complete group was trained, dropped with a reason, or waits on buffer.groups or the processor's input
    assert complete <= trained.keys() | dropped.keys() | emitted | unread
    assert trained.keys() <= emitted
    print(f"{len(complete)} complete groups: {len(trained)} trained, {len(dropped)} dropped "
          f"{collections.Counter(dropped.values())}, {len(emitted - trained.keys() - dropped.keys())} left buffered")


# Where each life of the trainer is SIGKILLed: held at a point of a step, at its N-th pass in that
# life. A life killed at pass N has checkpointed N - 1 steps since it resumed: 2 in all, so the
# run (6 steps) is still going at the last kill. Pass 1 of trainer.collected is just after start-up.
TRAINER_KILLS = (("trainer.published", 2), ("trainer.checkpoint_written", 1), ("trainer.collected", 2),
                 ("trainer.collected", 1), ("trainer.published", 1))


def test_trainer_killed_at_every_point_of_a_step_loses_no_group_and_trains_none_twice(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(trainer={"steps": 6, "checkpoint_every": 1},
                             run={"max_wall_s": 600, "max_restarts": len(TRAINER_KILLS) + 2})
    run_dir = Path(cfg.run.run_dir)
    assert sum(at_pass - 1 for _, at_pass in TRAINER_KILLS) < cfg.trainer.steps
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm(*TRAINER_KILLS[0])
    runner, outcome = start_run(cfg)
    try:
        for number, (point, _) in enumerate(TRAINER_KILLS, start=1):
            pid = holds.wait_held(point, 300, running(runner, f"the trainer held at {point} for kill {number}"))
            if number < len(TRAINER_KILLS):  # armed before this kill: the next life cannot pass it unarmed
                holds.arm(*TRAINER_KILLS[number])
            sigkill(pid)
            holds.release(point, pid)
        runner.join(600)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["steps"] == cfg.trainer.steps
    assert (run_dir / "logs" / "trainer.log").read_text().count("==== life") >= len(TRAINER_KILLS) + 1

    audit = audit_run(run_dir)
    print(audit)
    command = [sys.executable, "-m", "milestream.cli", "audit", "--run-dir", str(run_dir)]
    assert json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)["exact"]
    assert audit.steps == cfg.trainer.steps and not audit.missing_steps
    assert audit.groups_lost == [] and audit.groups_duplicated == []
    assert audit.groups_trained == cfg.trainer.steps * cfg.trainer.batch_groups


def test_redis_killed_mid_run_comes_back_with_the_ledger_rebuilt_from_the_log(cfg, tmp_path, monkeypatch, capsys):
    """The embedded Redis SIGKILLed while the trainer holds step 2's batch (step 1 published and
    checkpointed; the batch's groups already left the queue in Redis, though the checkpoint has not
    seen them): the run stops its stages, starts an empty Redis, rebuilds the ledger from the broker's
    topics, rollout's committed offsets and the trainer's checkpoint, and finishes with its credit balanced."""
    cfg = cfg.with_overrides(redis={"url": None, "password": "supervision"},  # its own embedded Redis, to kill
                             trainer={"steps": 6, "checkpoint_every": 1}, run={"max_wall_s": 400})
    run_dir = Path(cfg.run.run_dir)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected", at_pass=2)
    runner, outcome = start_run(cfg)
    try:
        trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer held at step 2"))
        live = load_config(run_dir / "config.yaml").with_overrides(redis={"password": "supervision"})
        server = redis_client(live.redis)
        # no snapshot, no append-only file, nothing in its folder: what comes back comes from the log
        assert server.config_get("save") == {"save": ""} and server.config_get("appendonly") == {"appendonly": "no"}
        assert not list(Path(server.config_get("dir")["dir"]).iterdir())
        sigkill(redis_pids(live)[0])
        holds.release("trainer.collected", trainer)
        runner.join(600)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    summary = outcome["summary"]
    assert summary["steps"] == cfg.trainer.steps
    assert summary["buffer"]["unaccounted"] == 0, summary["buffer"]
    assert "rebuilt the buffer ledger on a new Redis" in capsys.readouterr().out
    for stage in ("loader", "processor", "rollout-0", "trainer"):  # every stage started again on the new Redis
        assert (run_dir / "logs" / f"{stage}.log").read_text().count("==== life") >= 2, stage

    audit = audit_run(run_dir)
    print(audit)
    assert audit.exact and audit.steps == cfg.trainer.steps
    assert audit.groups_trained == cfg.trainer.steps * cfg.trainer.batch_groups


@pytest.mark.timeout(1500)  # two lives of every stage, the held archiver's stop grace
def test_broker_crash_with_the_archive_behind_the_trainers_checkpoint_rolls_the_trainer_back(cfg, tmp_path,
                                                                                            monkeypatch):
    """The window of issue 27: the archiver held (as a slow or restarting one would be) while the trainer
    checkpoints groups it never archived, then the broker SIGKILLed. The archive is the log that survives;
    the trainer goes back to its newest checkpoint the archive covers, redoes the steps after it, and the
    run's audit is exact (no group trained on a lost timeline, none trained twice or also dropped)."""
    cfg = cfg.with_overrides(broker={"bootstrap_servers": None},  # its own embedded broker, to crash
                             trainer={"steps": 10, "checkpoint_every": 1, "keep_checkpoints": 10},
                             run={"max_wall_s": 900, "max_restarts": 5})
    run_dir = Path(cfg.run.run_dir)

    def archived_groups() -> dict[int, int]:
        return ArchiveState.load(run_dir).offsets.get(topics.GROUPS.name, {})

    def latest_past(ends: dict[int, int]) -> bool:
        latest = checkpoint.latest_step(run_dir)
        offsets = checkpoint.saved_offsets(checkpoint.saved(run_dir)[latest]) if latest else {}
        return any(o > ends.get(p, 0) for p, o in offsets.items())

    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected", at_pass=3)
    runner, outcome = start_run(cfg)
    try:
        trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer held at step 3"))
        wait_for(lambda: checkpoint.latest_step(run_dir) in covered_checkpoints(run_dir, archived_groups()), 120,
                 "the archive to cover checkpoint 2", runner)
        covered = checkpoint.latest_step(run_dir)
        holds.arm("archiver.flushing")
        holds.wait_held("archiver.flushing", 120, running(runner, "the archiver held"))
        ends = archived_groups()  # what the archive will hold when the broker goes
        while not latest_past(ends):  # step on until a checkpoint holds groups the archive never got
            assert checkpoint.latest_step(run_dir) < cfg.trainer.steps - 1, "no checkpoint got past the archive"
            holds.arm("trainer.collected")
            holds.release("trainer.collected", trainer)
            trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer's next step"))
        lost = checkpoint.latest_step(run_dir)
        sigkill(broker_pids(load_config(run_dir / "config.yaml"))[0])
        holds.release("trainer.collected", trainer)  # the archiver stays held: its rows go with the broker
        runner.join(600)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["steps"] == cfg.trainer.steps
    trainer_log = (run_dir / "logs" / "trainer.log").read_text().split("==== life")[-1]
    resumed_at = int(trainer_log.split("resumed at step ")[1].split()[0])
    assert covered <= resumed_at < lost, (covered, resumed_at, lost)

    audit = audit_run(run_dir)
    print(audit)
    assert audit.exact and audit.steps == cfg.trainer.steps and not audit.missing_steps
    assert audit.groups_trained == cfg.trainer.steps * cfg.trainer.batch_groups
