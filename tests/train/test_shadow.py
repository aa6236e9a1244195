"""``milestream train --shadow``: a second trainer on a run's buffer.groups, under its own group id and knobs, that
publishes no weights, gives no credit back and writes none of the run's drops or dead letters."""
from __future__ import annotations

from stage_runs import end_offsets, run_showing_logs

from milestream.log.reader import BrokerSource
from milestream.schemas import topics
from milestream.streams.ledger import BufferLedger
from milestream.train import checkpoint
from milestream.train.trainer import Trainer

UNTOUCHED = (topics.WEIGHT_VERSIONS, topics.DROPPED, topics.DEADLETTER, topics.PROMPTS)


def buffer_state(cfg) -> tuple:
    ledger = BufferLedger(cfg)
    return ledger.balance(), ledger.version_floor(), ledger.trainer_version(), ledger.run_totals()


def test_a_shadow_trains_on_the_runs_groups_and_leaves_the_run_as_it_was(cfg, tmp_path):
    assert run_showing_logs(cfg)["steps"] == cfg.trainer.steps
    before, buffer_before = end_offsets(cfg, UNTOUCHED), buffer_state(cfg)

    shadow = cfg.with_overrides(trainer={"shadow": True, "steps": 2, "lr": 1e-3}, run={"run_dir": str(tmp_path / "ab")})
    Trainer(shadow).run()

    assert end_offsets(cfg, UNTOUCHED) == before and buffer_state(cfg) == buffer_before
    source = BrokerSource(cfg)
    source.prefetch((topics.GROUPS, topics.METRICS))
    emitted = {r.group_id for m in source.messages(topics.GROUPS) for r in m.records}
    steps = [r for m in source.messages(topics.METRICS) for r in m.records if r.source == "shadow/ab"]
    assert [r.step for r in steps] == [1, 2]
    trained = [g for r in steps for g in r.group_ids]
    assert len(set(trained)) == 4 and set(trained) <= emitted
    assert checkpoint.latest_step(tmp_path / "ab") == 2
    assert not (tmp_path / "ab" / "weights").exists()
