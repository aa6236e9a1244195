"""A reward that raises on some samples, through the real rollout worker, processor and buffer ledger:
those groups leave on buffer.dropped with reason reward_error, the others reach buffer.groups, and
every credit comes back once everything is settled."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from synthetic import ProcessorProcess, topic_reader, wait_until

from milestream.engines.engine import CpuEngine
from milestream.infra.model import load_tokenizer
from milestream.producers.loader import load_prompts
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger

PLUGINS = str(Path(__file__).parents[1] / "plugins")
PROMPTS = 4  # the buffer's capacity in the test configuration: rows 1 and 3 fail, rows 0 and 2 train


def test_groups_whose_reward_failed_are_dropped_and_their_credit_comes_back(cfg, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{row} + 1 =", "label": str(row + 1), "row": row}) + "\n"
                            for row in range(PROMPTS)))
    cfg = cfg.with_overrides(data={"path": str(data), "metadata_keys": ["row"], "shuffle": False},
                             reward={"fn": "reward_hooks:fails_on_odd_rows"})
    ledger = BufferLedger(cfg)
    assert ledger.available() == cfg.buffer_capacity == PROMPTS
    load_prompts(cfg, count=PROMPTS)
    processor = ProcessorProcess(cfg, tmp_path)
    processor.start()
    dropped_reader, groups_reader = topic_reader(cfg, topics.DROPPED), topic_reader(cfg, topics.GROUPS)
    dropped, emitted = [], {}
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(cfg, stop))
    worker.start()
    try:
        def all_settled() -> bool:
            processor.assert_alive()
            dropped.extend(r for d in dropped_reader.drain(idle_s=0.2) for r in d.records)
            emitted.update((d.records[0].group_id, d.records) for d in groups_reader.drain(idle_s=0.2))
            return len(dropped) + len(emitted) == PROMPTS
        wait_until(all_settled, 180, "every group on buffer.groups or buffer.dropped")
        stop.set()  # a worker waiting for a prompt holds a credit while it polls
        worker.join()
        # the dropped groups' credit comes back when their drop is settled, a moment after it is readable
        wait_until(lambda: ledger.available() == 2, 30, "the credit of the two dropped groups")
    except BaseException:
        print(processor.log_tail())
        raise
    finally:
        stop.set()
        worker.join()
        processor.stop()
        dropped_reader.close()
        groups_reader.close()

    assert sorted(d.group_id for d in dropped) == ["rows-s42-e0-1#0", "rows-s42-e0-3#0"]
    for record in dropped:
        assert record.reason == "reward_error" and record.dropped_by == "processor"
        assert record.detail.endswith(f"RuntimeError: no reward for row {record.group_id[-3]}")
    assert sorted(emitted) == ["rows-s42-e0-0#0", "rows-s42-e0-2#0"]
    for manifest in emitted.values():
        assert [row.reward for row in manifest] == [1.0] * cfg.rollout.group_size
    for group_id in emitted:  # the trainer takes the emitted groups: the buffer is empty again
        assert ledger.leave(group_id)
    assert ledger.available() == cfg.buffer_capacity  # no credit leaked


def run_worker(cfg, stop: threading.Event) -> None:
    async def main() -> None:
        engine = CpuEngine(cfg.model, cfg.rollout, seed=1)
        worker = RolloutWorker(cfg, "w-test", engine, load_tokenizer(cfg.model))
        done = asyncio.Event()
        task = asyncio.create_task(worker.run(done))
        await asyncio.to_thread(stop.wait)
        done.set()
        await task
        await engine.close()

    asyncio.run(main())
