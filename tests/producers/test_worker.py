"""The rollout worker against the real broker and Redis: publishing, and backpressure through credit."""
from __future__ import annotations

import asyncio

import pytest
from holds import Holds
from stage_runs import published_groups, run_until

from milestream.infra.kafka import RecordConsumer
from milestream.infra.model import load_tokenizer
from milestream.engines.engine import CpuEngine
from milestream.infra.faults import InjectedFault
from milestream.producers.loader import load_prompts
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger


def test_worker_publishes_groups_and_stalls_without_credit(cfg):
    load_prompts(cfg, count=20)
    credit = BufferLedger(cfg)
    engine = CpuEngine(cfg.model, cfg.rollout, seed=1)
    worker = RolloutWorker(cfg, "w-test", engine, load_tokenizer(cfg.model))
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    seen: dict[str, list] = {}
    capacity = cfg.buffer_capacity

    def full_groups() -> int:
        published_groups(trajectories, seen)
        return sum(len(v) == cfg.rollout.group_size for v in seen.values())

    asyncio.run(run_until(worker, lambda: full_groups() >= capacity))  # stopped and flushed
    assert full_groups() == capacity and credit.prompts_admitted() == capacity  # no credit left: nothing more
    assert credit.available() == 0
    for group in seen.values():
        assert sorted(t.sample_index for t in group) == list(range(cfg.rollout.group_size))
        for t in group:
            assert len(t.response_ids) == len(t.loss_mask) == len(t.token_versions) > 0
            assert t.status in ("completed", "truncated") and t.token_versions == [0] * len(t.response_ids)

    assert credit.settle(next(iter(seen)), "filtered")  # one group left the buffer: exactly one more is admitted
    worker = RolloutWorker(cfg, "w-test", engine, load_tokenizer(cfg.model))
    asyncio.run(run_until(worker, lambda: full_groups() >= capacity + 1))
    assert full_groups() == capacity + 1 and credit.prompts_admitted() == capacity + 1
    asyncio.run(engine.close())
    trajectories.close()


def test_the_engines_top_k_logprobs_are_published_with_each_sample(cfg):
    cfg = cfg.with_overrides(rollout={"logprobs_topk": 3})
    load_prompts(cfg, count=4)
    engine = CpuEngine(cfg.model, cfg.rollout, seed=1)
    worker = RolloutWorker(cfg, "w-test", engine, load_tokenizer(cfg.model))
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    logprobs = RecordConsumer(cfg.broker, topics.LOGPROBS, "audit").assign(partitions=range(cfg.broker.partitions))
    seen: dict[str, list] = {}
    asyncio.run(run_until(worker, lambda: len(published_groups(trajectories, seen)) >= 1))
    asyncio.run(engine.close())
    responses = {t.trajectory_id: t.response_ids for group in seen.values() for t in group}
    records = [r for d in logprobs.drain(idle_s=0.5, max_wait_s=10) for r in d.records if r.trajectory_id in responses]
    assert len(records) == len(responses) >= cfg.rollout.group_size
    for record in records:
        response = responses[record.trajectory_id]
        assert len(record.topk_ids) == len(record.topk_logprobs) == len(record.logprobs) == len(response)
        for token, logprob, ids, values in zip(response, record.logprobs, record.topk_ids, record.topk_logprobs):
            assert len(ids) == 3 and values == sorted(values, reverse=True)
            assert token not in ids or values[ids.index(token)] == logprob
    trajectories.close()
    logprobs.close()


def test_a_worker_whose_admission_fails_stops_with_the_error(cfg, tmp_path, monkeypatch):
    """An exception in a task is seen by nobody unless awaited: a worker whose admission loop failed must end
    with that error (the stage restarts and the prompts it held go to another member), not stay in the
    prompts group holding partitions while admitting nothing."""
    load_prompts(cfg, count=2)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.fail("worker.admitting")
    engine = CpuEngine(cfg.model, cfg.rollout, seed=1)
    worker = RolloutWorker(cfg, "w-failing", engine, load_tokenizer(cfg.model))
    with pytest.raises(InjectedFault, match="worker.admitting"):
        asyncio.run(asyncio.wait_for(worker.run(asyncio.Event()), timeout=120))
    asyncio.run(engine.close())
