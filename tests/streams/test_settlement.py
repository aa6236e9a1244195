"""Settling a group in the buffer ledger exactly once (with its credit) however often it is sent, and the
processor's view of a group that left before a restart."""
from __future__ import annotations

from synthetic import trajectory

from milestream.streams.groups import GroupAssembler
from milestream.streams.ledger import EMITTED, SENDING, SETTLED, Begun, BufferLedger


def test_a_group_is_settled_and_accounted_once_however_often_it_is_sent(cfg):
    ledger = BufferLedger(cfg)
    available = ledger.available()
    assert ledger.settlement("g#0") is None
    assert ledger.begin_sending("g#0") == Begun(None)
    # sent again, as after a restart: a possible duplicate, and the outcome chosen first stands
    assert ledger.begin_sending("g#0", "stale") == Begun(SENDING, EMITTED)
    assert ledger.settlement("g#0") == SENDING and ledger.decided(["g#0", "d#0"]) == {"g#0": EMITTED}
    assert ledger.settle("g#0", EMITTED, 3)
    assert not ledger.settle("g#0", EMITTED, 3)
    assert ledger.settlement("g#0") == SETTLED and ledger.begin_sending("g#0") == Begun(SETTLED)
    assert ledger.decided(["g#0"]) == {}
    assert ledger.begin_sending("d#0", "aborted") == Begun(None) and ledger.settle("d#0", "aborted")
    assert not ledger.settle("d#0", "aborted")
    assert ledger.run_totals() == {"groups_out": 1, "groups_resent": 1, "dropped_aborted": 1}
    assert ledger.settled_or_sending() == {"g#0", "d#0"}
    assert ledger.queued() == 1  # the emitted group waits for the trainer
    assert ledger.available() == available + 1  # the dropped group's credit came back, once


def test_the_queue_knows_each_waiting_groups_staleness_and_a_group_leaves_it_once(cfg):
    ledger = BufferLedger(cfg)
    available = ledger.available()
    for group_id, oldest in (("a#0", 1), ("b#0", 4)):
        ledger.begin_sending(group_id)
        ledger.settle(group_id, EMITTED, oldest)
    assert ledger.figures(5) == {"queue_size": 2.0, "queue_staleness_mean": 2.5, "queue_staleness_max": 4.0,
                                 "credit_available": float(available)}
    assert ledger.leave("a#0")
    assert not ledger.leave("a#0")  # taken again by a restarted trainer: no second credit
    assert ledger.queued_versions() == [4] and ledger.available() == available + 1


def test_a_group_the_trainer_takes_before_it_is_settled_gives_its_credit_back_at_settlement(cfg):
    ledger = BufferLedger(cfg)
    available = ledger.available()
    ledger.begin_sending("early#0")
    assert ledger.leave("early#0")  # read from buffer.groups before the delivery report came
    assert not ledger.leave("early#0")  # and again by a restarted trainer: it had left already
    assert ledger.available() == available
    ledger.settle("early#0", EMITTED, 2)
    assert ledger.queued() == 0 and ledger.available() == available + 1
    assert not ledger.leave("early#0")


def test_records_of_a_group_that_left_before_a_restart_are_duplicates():
    assembler = GroupAssembler()
    assert not assembler.knows("g#0")
    assembler.mark_finished("g#0")  # settled in Redis by an earlier life of the processor
    assert assembler.knows("g#0")
    assert assembler.add(trajectory("g#0", 0, 2)) == (None, False)
    assert "g#0" not in assembler.partial
