"""The processor's restart bookkeeping on its own: where a source partition may be committed, and
settling a group in Redis exactly once (with its credit) however often it is sent."""
from __future__ import annotations

from faust.types import TP
from synthetic import trajectory

from milestream.streams.credit import Credit
from milestream.streams.groups import GroupAssembler
from milestream.streams.processor import SENDING, SETTLED, Settlements, SourceOffsets

TRAJECTORIES = TP("rollout.trajectories", 0)


def test_commit_point_stays_at_the_oldest_offset_still_held():
    offsets = SourceOffsets([TRAJECTORIES.topic])
    assert offsets.commit_point(TRAJECTORIES) is None  # nothing read: nothing to commit
    for offset in range(5):
        offsets.read(TRAJECTORIES, offset)
    for offset in (1, 2, 4):  # a later group left first
        offsets.released(TRAJECTORIES, offset)
    assert offsets.commit_point(TRAJECTORIES) == 0
    offsets.released(TRAJECTORIES, 0)
    assert offsets.commit_point(TRAJECTORIES) == 3
    offsets.released(TRAJECTORIES, 3)
    assert offsets.commit_point(TRAJECTORIES) == 5 and offsets.held() == 0


def test_an_offset_delivered_twice_is_held_until_both_copies_are_released():
    offsets = SourceOffsets([TRAJECTORIES.topic])
    offsets.read(TRAJECTORIES, 7)  # held by a partial group
    offsets.read(TRAJECTORIES, 7)  # the same record again after a rebalance: a duplicate
    offsets.released(TRAJECTORIES, 7)  # the duplicate is let go at once
    assert offsets.commit_point(TRAJECTORIES) == 7
    offsets.released(TRAJECTORIES, 7)
    assert offsets.commit_point(TRAJECTORIES) == 8


def test_a_group_is_settled_and_accounted_once_however_often_it_is_sent(cfg):
    settlements, credit = Settlements(cfg), Credit(cfg)
    available = credit.available()
    assert settlements.state("g#0") is None
    assert settlements.begin("g#0") is None
    assert settlements.begin("g#0") == SENDING  # sent again, as after a restart: a possible duplicate
    assert settlements.settle("g#0", "emitted", 3)
    assert not settlements.settle("g#0", "emitted", 3)
    assert settlements.state("g#0") == SETTLED and settlements.begin("g#0") == SETTLED
    assert settlements.begin("d#0") is None and settlements.settle("d#0", "aborted")
    assert not settlements.settle("d#0", "aborted")
    assert settlements.totals() == {"groups_out": 1, "groups_resent": 1, "dropped_aborted": 1}
    assert credit.queued() == 1  # the emitted group waits for the trainer
    assert credit.available() == available + 1  # the dropped group's credit came back, once


def test_the_queue_knows_each_waiting_groups_staleness_and_a_group_leaves_it_once(cfg):
    settlements, credit = Settlements(cfg), Credit(cfg)
    available = credit.available()
    for group_id, oldest in (("a#0", 1), ("b#0", 4)):
        settlements.begin(group_id)
        settlements.settle(group_id, "emitted", oldest)
    assert credit.queue_figures(5) == {"queue_size": 2.0, "queue_staleness_mean": 2.5, "queue_staleness_max": 4.0}
    assert credit.leave("a#0")
    assert not credit.leave("a#0")  # taken again by a restarted trainer: no second credit
    assert credit.queued_versions() == [4] and credit.available() == available + 1


def test_a_group_the_trainer_takes_before_it_is_settled_gives_its_credit_back_at_settlement(cfg):
    settlements, credit = Settlements(cfg), Credit(cfg)
    available = credit.available()
    settlements.begin("early#0")
    assert credit.leave("early#0")  # read from buffer.groups before the delivery report came
    assert not credit.leave("early#0")  # and again by a restarted trainer: it had left already
    assert credit.available() == available
    settlements.settle("early#0", "emitted", 2)
    assert credit.queued() == 0 and credit.available() == available + 1
    assert not credit.leave("early#0")


def test_records_of_a_group_that_left_before_a_restart_are_duplicates():
    assembler = GroupAssembler()
    assert not assembler.knows("g#0")
    assembler.mark_finished("g#0")  # settled in Redis by an earlier life of the processor
    assert assembler.knows("g#0")
    assert assembler.add(trajectory("g#0", 0, 2)) == (None, False)
    assert "g#0" not in assembler.partial
