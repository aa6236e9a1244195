"""A group's fate is decided once, across processor lives.

A processor SIGKILLed after its group's manifest (or drop) reached the broker, before it settled the group,
comes back and re-reads the group's records. Its verdict now may differ: the stale pre-drop depends on the
trainer's version when it is decided, the expiry on the clock, a user's filter on whatever it reads, and a
run may be restarted with another configuration. Whatever it finds, the later life sends the group as the
first decided, so a group is never both on ``buffer.groups`` (where the trainer may already have trained
it) and on ``buffer.dropped``: the run's audit would count it trained and dropped.
"""
from __future__ import annotations

from synthetic import ProcessorProcess, admit, group_records, topic_reader, wait_until, with_credit

from holds import Holds
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.streams.ledger import SENDING, SETTLED, BufferLedger


def publish(cfg, group_id: str) -> None:
    producer = RecordProducer(cfg.broker, client_id="decided-once-test")
    for spec, record in group_records(group_id, cfg.rollout.group_size):  # every token of version 0
        producer.send(spec, [record], key=group_id)
    producer.flush()


def values_on(cfg, spec: topics.TopicSpec) -> list[list]:
    """The records of each value on ``spec`` (a group's manifest, a drop)."""
    reader = topic_reader(cfg, spec)
    try:
        return [delivery.records for delivery in reader.drain(idle_s=2.0)]
    finally:
        reader.close()


def groups_on(cfg, spec: topics.TopicSpec) -> list[str]:
    return [records[0].group_id for records in values_on(cfg, spec)]


def kill_after_delivery(cfg, tmp_path, monkeypatch, group_id: str) -> BufferLedger:
    """A processor life delivers the group's outcome and is SIGKILLed before it settles the group."""
    admit(cfg, [group_id])
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("processor.delivered")
    first = ProcessorProcess(cfg, tmp_path / "first")
    first.start()
    try:
        publish(cfg, group_id)
        held = holds.wait_held("processor.delivered", 120, first.assert_alive)
    except BaseException:
        print(first.log_tail())
        raise
    first.kill()
    holds.release("processor.delivered", held)
    ledger = BufferLedger(cfg)
    assert ledger.settlement(group_id) == SENDING
    return ledger


def settle_in_a_later_life(later_cfg, tmp_path, ledger: BufferLedger, group_id: str) -> None:
    """A processor on ``later_cfg`` re-reads the group's records (never committed) and settles it."""
    later = ProcessorProcess(later_cfg, tmp_path / "later")
    later.start()

    def settled() -> bool:
        later.assert_alive()
        return ledger.settlement(group_id) == SETTLED
    try:
        wait_until(settled, 120, f"{group_id} settled by the later life")
    finally:
        later.stop()


def test_a_group_emitted_by_a_killed_life_is_not_pre_dropped_by_the_next(cfg, tmp_path, monkeypatch):
    cfg = with_credit(cfg, 1).with_overrides(buffer={"max_staleness": 2})
    ledger = kill_after_delivery(cfg, tmp_path, monkeypatch, "kept#0")
    assert groups_on(cfg, topics.GROUPS) == ["kept#0"]  # the first life's manifest is on the log
    ledger.raise_trainer_version(5)  # the trainer moved on: to a new life the group is past the window
    settle_in_a_later_life(cfg, tmp_path, ledger, "kept#0")
    assert groups_on(cfg, topics.DROPPED) == []
    assert set(groups_on(cfg, topics.GROUPS)) == {"kept#0"}  # sent again, as emitted: the trainer de-duplicates
    totals = ledger.run_totals()
    assert (totals.get("groups_resent"), totals.get("groups_out"), totals.get("dropped_stale")) == (1, 1, None), totals
    assert ledger.queued() == 1 and ledger.balance()["unaccounted"] == 0


def test_a_group_dropped_by_a_killed_life_stays_dropped_when_the_next_would_keep_it(cfg, tmp_path, monkeypatch):
    cfg = with_credit(cfg, 1).with_overrides(buffer={"max_staleness": 2})
    BufferLedger(cfg).raise_trainer_version(5)  # its tokens are of version 0: stale to the first life
    ledger = kill_after_delivery(cfg, tmp_path, monkeypatch, "gone#0")
    assert groups_on(cfg, topics.DROPPED) == ["gone#0"]
    # the run restarted with a wider window: the later life alone would emit the group
    settle_in_a_later_life(cfg.with_overrides(buffer={"max_staleness": 10}), tmp_path, ledger, "gone#0")
    assert groups_on(cfg, topics.GROUPS) == []
    drops = [drop for records in values_on(cfg, topics.DROPPED) for drop in records]
    assert [d.reason for d in drops] == ["stale", "stale"], drops
    assert drops[1].detail == "stale, as an earlier life of the processor decided"
    totals = ledger.run_totals()
    assert (totals.get("groups_resent"), totals.get("groups_out"), totals.get("dropped_stale")) == (1, None, 1), totals
    assert ledger.queued() == 0 and ledger.balance()["unaccounted"] == 0
