"""Fully async keeps what it generates: a group delayed across versions is trained, not dropped, while the
staleness bound allows it, and the exactly-once audit stays exact.

Held by construction: one of two rollout workers holds after publishing the first sample of a group (at
version 0) while the other keeps the trainer going until it has published version 1. Then the held worker lets
its group finish and the trainer, let go once the group is on buffer.groups, collects it at version 1 or, at the
latest, at 2, the bound's edge: the default selector (``soonest_stale_first``) takes the group that goes stale
soonest ahead of fresher groups that arrived first, where first in, first out could leave it for version 3 and
the bound would drop it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from emitted import emit, simple_group
from holds import Holds
from stage_runs import print_logs_unless_done, running, start_run, wait_for

from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.log.audit import archived_lineage, audit_run
from milestream.schemas import topics
from milestream.streams.ledger import SETTLED, BufferLedger, Reconciled
from milestream.train.collector import GroupCollector


def test_the_group_that_goes_stale_soonest_is_trained_first_and_nothing_is_dropped(cfg):
    producer = RecordProducer(cfg.broker)
    # "late" (oldest token at version 1) completes after two groups of version 3: at version 3 it is at the
    # bound, so the batch takes it; left for version 4 it would be dropped stale
    emit(cfg, producer, [r for gid, version in (("x", 3), ("y", 3), ("late", 1))
                         for r in simple_group(gid, version, cfg.rollout.group_size)])
    collector = GroupCollector(cfg, producer, {}, list(range(cfg.broker.partitions)), set())
    while len(collector.pool) < 3:
        collector._read(timeout=1.0)
    # it arrived last (the partitions of the three are read in any order)
    collector.pool["late"] = dataclasses.replace(collector.pool["late"], arrival=collector.arrivals)
    first = collector.take(2, version=3, stopping=lambda: False)
    assert "late" in {g.group_id for g, _ in first} and max(lag for _, lag in first) == 2
    second = collector.take(1, version=4, stopping=lambda: False)
    assert [lag for _, lag in second] == [1] and collector.dropped_stale == 0
    collector.close()


def worker_id_of(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--worker-id") + 1]


def published_by(cfg, worker_id: str) -> set[str]:
    """The groups of which ``worker_id`` has a sample on rollout.trajectories."""
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "test-published")
    trajectories.assign(partitions=range(cfg.broker.partitions))
    try:
        return {t.group_id for d in trajectories.drain(idle_s=1.0) for t in d.records if t.worker_id == worker_id}
    finally:
        trajectories.close()


def split_the_prompts(run_dir: Path, partitions: int) -> bool:
    """Both workers hold a share of the prompts' partitions (their logs' last assignment): a held worker then
    blocks no rebalance, which would wait for it for as long as the hold lasts (max.poll.interval.ms)."""
    def share(log: Path) -> list[str]:
        lines = [line for line in log.read_text().splitlines() if ".rollout assigned" in line or ".rollout revoked" in line]
        if not lines or "assigned" not in lines[-1]:
            return []
        return [p for p in lines[-1].split("partitions")[-1].strip(" []").split(", ") if p]
    shares = [share(run_dir / "logs" / f"rollout-{i}.log") for i in range(2)
              if (run_dir / "logs" / f"rollout-{i}.log").exists()]
    return len(shares) == 2 and all(0 < len(s) < partitions for s in shares)


def test_a_group_delayed_across_versions_is_trained_within_the_bound_and_the_audit_stays_exact(cfg, monkeypatch,
                                                                                             tmp_path):
    # two workers, one group in flight each (4 slots, groups of 4); room for 3 batches of 2, bound 2. Group
    # refill: a group keeps its slots until its last sample is published, so the held worker holds two credits
    # at most (its group's and the next one's). With sample refill its samples free their slots while they
    # are scored, it admits more groups before the first is published, and their credit could leave the other
    # worker's next group stale by the projection (behind) until the hold ends
    cfg = cfg.with_overrides(rollout={"num_workers": 2, "max_inflight_samples": 4, "refill": "group"},
                             buffer={"capacity_factor": 3.0, "max_staleness": 2},
                             trainer={"steps": 4}, run={"max_wall_s": 600})
    BufferLedger(cfg).reconcile(Reconciled(credit=cfg.buffer_capacity, queue={}, prompts_admitted=0))  # its size
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("loader.publishing")  # no prompt before both workers are in the group
    holds.arm("worker.sample_published")  # the first sample on the log: its group's oldest token is version 0
    holds.arm("trainer.published")  # version 1 announced
    runner, outcome = start_run(cfg)
    ledger = BufferLedger(cfg)
    try:
        loader = holds.wait_held("loader.publishing", 300, running(runner, "the prompt feeder"))
        wait_for(lambda: split_the_prompts(Path(cfg.run.run_dir), cfg.broker.partitions), 300,
                 "both workers in the rollout group", runner)
        holds.release("loader.publishing", loader)
        held_worker = holds.wait_held("worker.sample_published", 300, running(runner, "a worker's first sample"))
        trainer = holds.wait_held("trainer.published", 300, running(runner, "version 1, from the other worker"))
        assert ledger.trainer_version() == 1
        (delayed,) = published_by(cfg, worker_id_of(held_worker))  # its one sample so far
        holds.release("worker.sample_published", held_worker)
        wait_for(lambda: ledger.settlement(delayed) == SETTLED, 300, "the delayed group on buffer.groups", runner)
        holds.release("trainer.published", trainer)
        runner.join(600)
    finally:
        holds.release_all()
        print_logs_unless_done(Path(cfg.run.run_dir), outcome)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["steps"] == cfg.trainer.steps and outcome["summary"]["buffer"]["unaccounted"] == 0

    lineage = archived_lineage(cfg.run.run_dir)
    assert delayed not in lineage.drops
    [(step, lag)] = lineage.training()[delayed]  # trained once, collected at version step - 1
    assert (step, lag) in ((2, 1), (3, 2))
    audit = audit_run(cfg.run.run_dir)
    assert audit.exact, audit
    assert audit.groups_emitted == audit.groups_trained + audit.groups_dropped + audit.groups_buffered
    # what the log cost, on each step's record: the trainer's reads, the workers' writes, the processor's CPU
    costs = [{name: r.values[name] for name in ("log_read_s", "log_write_s", "processor_cpu_s")}
             for r in lineage.trainer_steps()]
    assert all(value >= 0 for c in costs for value in c.values()), costs
    assert all(sum(c[name] for c in costs) > 0 for name in costs[0]), costs
