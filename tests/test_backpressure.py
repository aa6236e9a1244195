"""Backpressure in the running loop: a paused trainer stalls rollout, and the buffer stays bounded."""
from __future__ import annotations

import time

from milestream.infra.kafka import RecordConsumer
from milestream.orchestrator import start_stages
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger

from holds import Holds


def wait_for(condition, timeout: float = 180.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.5)


def test_paused_trainer_stalls_rollout_within_capacity(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(trainer={"steps": 3})
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    (tmp_path / "logs").mkdir()
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected")  # paused with its first batch taken, before its first step
    children, trainer = start_stages(cfg, config_path, tmp_path / "logs")
    credit = BufferLedger(cfg)
    groups = RecordConsumer(cfg.broker, topics.GROUPS, "audit").assign(partitions=range(cfg.broker.partitions))
    emitted: set[str] = set()

    def count_emitted() -> int:
        emitted.update(d.records[0].group_id for d in groups.drain(idle_s=0.2, max_wait_s=5))
        return len(emitted)

    taken = cfg.trainer.batch_groups  # by the paused trainer; their credit came back
    held_by = None
    try:
        held_by = holds.wait_held("trainer.collected", 180)
        # with the trainer paused, rollout fills the buffer to capacity and then admits nothing more
        # (a worker holds a credit for a moment while it polls for a prompt: wait for the admissions too)
        wait_for(lambda: credit.prompts_admitted() >= cfg.buffer_capacity + taken and credit.available() == 0,
                 what="credit exhausted")
        admitted = credit.prompts_admitted()
        assert admitted == cfg.buffer_capacity + taken
        for _ in range(10):  # 10 s of watching: nothing new is admitted, the buffer never exceeds capacity
            time.sleep(1.0)
            assert credit.prompts_admitted() == admitted
            assert credit.queued() <= cfg.buffer_capacity
            assert count_emitted() <= cfg.buffer_capacity + taken  # nothing more was taken
        holds.release("trainer.collected", held_by)
        trainer.proc.wait(300)
        assert trainer.proc.returncode == 0
        assert credit.prompts_admitted() > admitted  # rollout resumed once the trainer took groups
    finally:
        if held_by is not None:
            holds.release("trainer.collected", held_by)
        for child in reversed(children):
            child.stop()
        groups.close()
