"""Memory under a backlog: the trainer is held (a hold point) after its first step while a burst of twenty batches
of groups (the buffer's whole capacity, ~0.8 MB of routing a sample, 266 MB in all) arrives. Two processor processes share
the partitions and stream the burst through without holding its records; the trainer, released, keeps the
backlog's manifests only and reads the records of one batch at a time. No one's peak memory (/proc VmHWM)
grows by more than a stated bound, far below the burst's size, and every group is trained: nothing is
dropped, and the audit is exact."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from synthetic import ProcessorProcess, admit, wait_until, with_credit

from holds import Holds
from milestream.infra.kafka import RecordProducer
from milestream.infra.secret_env import stage_environment
from milestream.log.audit import audit_run
from milestream.log.reader import BrokerSource
from milestream.orchestrator import Child
from milestream.schemas import routing, topics
from milestream.schemas.records import LogProbs, Routing, Trajectory
from milestream.streams.ledger import BufferLedger

BATCH, BURST_BATCHES, GROUP_SIZE = 4, 20, 4
PROMPT, RESPONSE = [1, 2, 3], 16
# the dense test model trains with routing replay off, so only the routing's size matters: a layout of many
# layers gives each sample about 0.7 MB of routing on tokens a 2-core machine trains in well under a second
LAYERS, TOP_K, EXPERTS = 8192, 8, 256
# peak RSS growth while the burst passes: a processor's (its librdkafka fetch queue is 32 MB, and a batch handed
# to Python holds up to as much again while the queue refills: +4 to +57 MB measured), and the trainer's
# past its first step's peak: the batch it trains and the next it reads, each ~13 MB of routing held as values
# and as decoded records, its reader's 8 MB queue, and the allocator's slack over the steps (84-102 MB measured,
# the same with a burst half this size: it does not grow with the backlog; before manifests it held the whole
# backlog's samples, twice the burst). Growth, not the peak: a process's baseline differs by tens of MB from one
# installation to another (158 and 204 MB measured for the same processor)
PROCESSOR_GROWTH_MB, TRAINER_GROWTH_MB = 96, 128


def routing_template() -> Routing:
    """One sample's routing, packed once and shared by every sample (each its own record)."""
    rng = np.random.default_rng(0)
    tokens = len(PROMPT) + RESPONSE - 1
    gaps = rng.integers(1, 32, size=(tokens, LAYERS, TOP_K))  # distinct ids per token and layer
    ids = (rng.integers(0, EXPERTS, size=(tokens, LAYERS, 1)) + np.cumsum(gaps, axis=2)) % EXPERTS
    (chunk,) = routing.pack("t/0", "t", 0, GROUP_SIZE, ids, EXPERTS)
    return chunk


def group_records(group_id: str, template: Routing) -> list:
    out = []
    for i in range(GROUP_SIZE):
        sample_id = f"{group_id}/{i}"
        out += [(topics.TRAJECTORIES, Trajectory(sample_id, group_id, group_id, i, GROUP_SIZE, PROMPT,
                                                 list(range(10, 10 + RESPONSE)), [1] * RESPONSE, [0] * RESPONSE,
                                                 float(i % 2), "completed", "", "e", "w", 0.0, 0.0, 1)),
                (topics.LOGPROBS, LogProbs(sample_id, group_id, i, GROUP_SIZE, [-0.5] * RESPONSE)),
                (topics.ROUTING, dataclasses.replace(template, trajectory_id=sample_id, group_id=group_id,
                                                     sample_index=i))]
    return out


def publish(cfg, groups: list[str], template: Routing) -> int:
    """The groups' records (admitted first, as a rollout worker does); the bytes published."""
    admit(cfg, groups)
    producer, sent = RecordProducer(cfg.broker, client_id="backlog-test"), 0
    for group_id in groups:
        for spec, record in group_records(group_id, template):
            sent += len(record.data) if isinstance(record, Routing) else 0
            producer.send(spec, [record], key=group_id)
    producer.flush()
    return sent


def memory_mb(pid: int, field: str) -> float:
    """VmRSS (now) or VmHWM (the peak) of a process, in MB."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def test_a_burst_while_the_trainer_is_held_stays_within_bounded_memory(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(trainer={"batch_groups": BATCH, "steps": 1 + BURST_BATCHES, "routing_replay": False,
                                      "checkpoint_every": 100},
                             buffer={"max_staleness": 100}, rollout={"group_size": GROUP_SIZE})
    cfg = with_credit(cfg, BATCH * BURST_BATCHES)  # the buffer holds the whole burst
    template = routing_template()
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.published")  # its first step done: the trainer's own memory for a step is in use
    processors = [ProcessorProcess(cfg, (tmp_path / f"processor-{i}")) for i in range(2)]
    for processor in processors:
        processor.start()
    alive = lambda: [processor.assert_alive() for processor in processors]  # noqa: E731
    config_path = tmp_path / "trainer.yaml"
    config_path.write_text(cfg.to_yaml())
    trainer = Child("trainer", ["train"], config_path, tmp_path, stage_environment(cfg))
    pids = {f"processor-{i}": p.proc.pid for i, p in enumerate(processors)} | {"trainer": trainer.proc.pid}
    try:
        publish(cfg, [f"first-{i}#0" for i in range(BATCH)], template)
        held = holds.wait_held("trainer.published", 180, alive)
        before = {name: memory_mb(pid, "VmHWM") for name, pid in pids.items()}
        burst = [f"burst-{i}#0" for i in range(BATCH * BURST_BATCHES)]
        burst_mb = publish(cfg, burst, template) / 1e6
        ledger = BufferLedger(cfg)
        wait_until(lambda: ledger.queued() == len(burst), 180, "the burst emitted, every group queued")
        holds.arm("trainer.published", at_pass=BURST_BATCHES)  # its last step done: its peak read there
        holds.release("trainer.published", held)
        last = holds.wait_held("trainer.published", 300, alive)
        peak = {name: memory_mb(pid, "VmHWM") for name, pid in pids.items()}
        holds.release("trainer.published", last)
        assert trainer.proc.wait(300) == 0, trainer.tail()
    except BaseException:
        print(*(processor.log_tail() for processor in processors), trainer.tail())
        raise
    finally:
        trainer.stop()
        for processor in processors:
            processor.stop()
    print(f"burst: {burst_mb:.0f} MB of routing; peak RSS (MB) before it {before}, after {peak}")
    assert burst_mb > max(PROCESSOR_GROWTH_MB, TRAINER_GROWTH_MB)
    for name in pids:
        assert peak[name] - before[name] < (TRAINER_GROWTH_MB if name == "trainer" else PROCESSOR_GROWTH_MB), name
    audit = audit_run(cfg.run.run_dir, BrokerSource(cfg, idle_s=1.0))
    assert audit.exact and audit.groups_dropped == 0, audit
    assert (audit.groups_trained, audit.steps) == (BATCH * (1 + BURST_BATCHES), 1 + BURST_BATCHES)
