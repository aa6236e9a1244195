"""Failures are events: an engine that raises on every step costs the groups it fails, not the run.

The engine is made to fail at a named point (``engine.step``, milestream/infra/faults.py) for as long as
the test wants; the test waits for what the log records (groups dropped with reason ``error``), never
for a moment in time. While it fails, more groups fail than the buffer holds, so the run goes on only
if each failed group gives its credit back.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from holds import Holds
from stage_runs import print_logs_unless_done, run_showing_logs, start_run, wait_for

from milestream.infra.kafka import RecordConsumer
from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import read_archive
from milestream.schemas import topics

FAULT = "InjectedFault: injected fault at engine.step"


class Drops:
    """The drop records on buffer.dropped so far, read as they come."""

    def __init__(self, cfg):
        self.reader = RecordConsumer(cfg.broker, topics.DROPPED, "test-drops").assign(
            partitions=range(cfg.broker.partitions))
        self.records: dict[str, object] = {}

    def count(self, reason: str) -> int:
        for delivery in self.reader.drain(idle_s=0.2, max_wait_s=5.0):
            for record in delivery.records:
                self.records.setdefault(record.group_id, record)
        return sum(d.reason == reason for d in self.records.values())


def test_an_engine_failing_for_a_while_costs_the_groups_it_failed_and_the_run_goes_on(cfg, tmp_path, monkeypatch):
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.fail("engine.step")
    cfg = cfg.with_overrides(trainer={"steps": 3}, rollout={"max_errors": 10_000}, run={"max_wall_s": 600})
    run_dir = Path(cfg.run.run_dir)
    runner, outcome = start_run(cfg)
    drops = Drops(cfg)
    try:
        # twice the groups the buffer holds fail: had their credit stayed taken, rollout would have stopped
        wait_for(lambda: drops.count("error") >= 2 * cfg.buffer_capacity, 300, "groups dropped as errors", runner)
        holds.recover("engine.step")
        runner.join(600)
    finally:
        holds.release_all()
        print_logs_unless_done(run_dir, outcome)
    summary = outcome["summary"]
    assert summary["steps"] == cfg.trainer.steps and summary["stopped_by"] == "steps"
    assert summary["buffer"]["unaccounted"] == 0, summary["buffer"]
    errors = [d for d in archived_lineage(run_dir).drops.values() if d.reason == "error"]
    assert len(errors) >= 2 * cfg.buffer_capacity
    assert all(FAULT in d.detail and d.dropped_by == "processor" for d in errors), errors[0]
    audit = audit_run(run_dir)
    assert audit.exact, audit
    # failures are figures too: each rollout report counts the groups that failed so far
    rollout = [m for msg in read_archive(run_dir, topics.METRICS) for m in msg.records if m.source.startswith("rollout/")]
    assert max(m.values["failed_groups"] for m in rollout) >= 2 * cfg.buffer_capacity


def test_an_engine_that_never_recovers_stops_the_run_naming_the_stage_and_the_last_error(cfg, tmp_path, monkeypatch):
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.fail("engine.step")
    cfg = cfg.with_overrides(rollout={"max_errors": 5, "error_window_s": 120}, run={"max_wall_s": 900})
    with pytest.raises(RuntimeError) as stopped:
        run_showing_logs(cfg)
    message = str(stopped.value)
    assert "stage rollout-0 stopped the run" in message, message
    assert "5 failed groups within 120 s" in message and FAULT in message, message

