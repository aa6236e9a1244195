"""Elastic rollout: workers join and leave a running ``milestream run``; one is killed hard halfway
through a group. The prompts consumer group rebalances; a killed worker's uncommitted prompts are redone
by another with the credit they already hold; a stopped one finishes or aborts its groups and records
them. Every state is reached by construction: worker-0's engine is held until the others have taken
part, the trainer is held at its first step until the scaling is over, and the run has fewer prompts
than the buffer has credit, so no worker ever waits for credit and a redone prompt is always read.
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from milestream_testkit.chaos import sigkill
from holds import Holds
from stage_runs import print_logs_unless_done, running, start_run, wait_for

from milestream.infra.kafka import RecordConsumer
from milestream.log.audit import archived_lineage, audit_run
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger, Reconciled


class Samples:
    """rollout.trajectories so far: each group's samples by worker."""

    def __init__(self, cfg):
        self.reader = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "test-samples").assign(
            partitions=range(cfg.broker.partitions))
        self.groups: dict[str, list] = {}

    def read(self) -> "Samples":
        for delivery in self.reader.drain(idle_s=0.2, max_wait_s=5.0):
            for t in delivery.records:
                self.groups.setdefault(t.group_id, []).append(t)
        return self

    def workers(self) -> set[str]:
        return {t.worker_id for samples in self.read().groups.values() for t in samples}

    def last_of(self, worker: str) -> str:
        """The group of the last sample ``worker`` published."""
        return max((t for samples in self.read().groups.values() for t in samples if t.worker_id == worker),
                   key=lambda t: t.finished_at).group_id


def start_worker(config: Path, worker_id: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "milestream.cli", "rollout", "--worker-id", worker_id,
                             "--config", str(config)], stdout=log.open("w"), stderr=subprocess.STDOUT)


def worker_of(pid: int, extra: dict[str, subprocess.Popen]) -> str:
    return next((name for name, proc in extra.items() if proc.pid == pid), "worker-0")


def test_rollout_scales_from_one_worker_to_three_and_back_with_one_killed_mid_group(cfg, tmp_path, monkeypatch):
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("engine.stepped")  # worker-0's engine, the only one running at first
    holds.arm("trainer.collected")
    cfg = cfg.with_overrides(data={"size": 40, "epochs": 1}, buffer={"capacity_factor": 25, "max_staleness": 100},
                             trainer={"steps": 4}, run={"max_wall_s": 900})
    assert cfg.buffer_capacity >= cfg.data.size
    BufferLedger(cfg).reconcile(Reconciled(credit=cfg.buffer_capacity, queue={}, prompts_admitted=0))  # the new size
    run_dir = Path(cfg.run.run_dir)
    runner, outcome = start_run(cfg)
    samples = Samples(cfg)
    extra: dict[str, subprocess.Popen] = {}
    try:
        engine_0 = holds.wait_held("engine.stepped", 300, running(runner, "worker-0's engine to hold"))
        extra = {name: start_worker(run_dir / "config.yaml", name, tmp_path / f"{name}.log")
                 for name in ("worker-1", "worker-2")}
        wait_for(lambda: samples.workers() >= set(extra), 300, "the new workers' samples", runner)
        trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer to hold"))

        holds.arm("worker.sample_published")  # whichever worker passes first holds, mid-group, and is killed
        holds.release("engine.stepped", engine_0)  # worker-0 has groups in flight: one worker will pass
        killed_pid = holds.wait_held("worker.sample_published", 300, running(runner, "a worker to hold"))
        killed = worker_of(killed_pid, extra)
        half_done = samples.last_of(killed)
        assert sigkill(killed_pid)
        holds.release("worker.sample_published", killed_pid)
        # the killed worker published part of it; another worker (or worker-0's next life, under the same
        # id) admits the prompt again, with the credit it holds, and completes the group
        wait_for(lambda: {t.sample_index for t in samples.read().groups[half_done]} == set(range(cfg.rollout.group_size)),
                 300, f"group {half_done} redone", runner)

        for name, proc in extra.items():  # scale in to worker-0 alone: a graceful stop of those still up
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=120) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        holds.release("trainer.collected", trainer)
        runner.join(900)
        workers = samples.workers()
    finally:
        holds.release_all()
        for proc in extra.values():
            proc.kill()
        samples.reader.close()
        print_logs_unless_done(run_dir, outcome)
        if "summary" not in outcome:  # the added workers log beside the run's stages
            for name in extra:
                print(f"==== {name}.log", (tmp_path / f"{name}.log").read_text()[-4000:], sep="\n")
    summary = outcome["summary"]
    assert summary["steps"] == cfg.trainer.steps and summary["buffer"]["unaccounted"] == 0, summary
    audit = audit_run(run_dir)
    assert audit.exact, audit
    lineage = archived_lineage(run_dir)
    assert half_done in lineage.emitted or half_done in lineage.drops  # the killed worker's group was not lost
    assert workers == {"worker-0", "worker-1", "worker-2"}
