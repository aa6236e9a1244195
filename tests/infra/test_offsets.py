"""Commit points: a partition is committed only below its oldest offset still held."""
from __future__ import annotations

from milestream.infra.offsets import HeldOffsets

TP = tuple[str, int]
TRAJECTORIES = ("rollout.trajectories", 0)


def test_commit_point_stays_at_the_oldest_offset_still_held():
    offsets: HeldOffsets[TP] = HeldOffsets()
    assert offsets.commit_point(TRAJECTORIES) is None and offsets.committable() == {}  # nothing read
    for offset in range(5):
        offsets.started(TRAJECTORIES, offset)
    for offset in (1, 2, 4):  # a later group left first
        offsets.done(TRAJECTORIES, offset)
    assert offsets.commit_point(TRAJECTORIES) == 0
    offsets.done(TRAJECTORIES, 0)
    assert offsets.commit_point(TRAJECTORIES) == 3
    offsets.done(TRAJECTORIES, 3)
    assert offsets.committable() == {TRAJECTORIES: 5} and offsets.held() == 0


def test_an_offset_delivered_twice_is_held_until_both_copies_are_done():
    offsets: HeldOffsets[TP] = HeldOffsets()
    offsets.started(TRAJECTORIES, 7)  # held by a partial group
    offsets.started(TRAJECTORIES, 7)  # the same record again after a rebalance: a duplicate
    offsets.done(TRAJECTORIES, 7)  # the duplicate is let go at once
    assert offsets.commit_point(TRAJECTORIES) == 7
    offsets.done(TRAJECTORIES, 7)
    assert offsets.commit_point(TRAJECTORIES) == 8


def test_a_resumed_reader_keeps_its_commit_points_until_it_reads_past_them():
    offsets: HeldOffsets[int] = HeldOffsets(resumed={0: 5, 1: 9})
    assert offsets.committable() == {0: 5, 1: 9}
    for offset in (5, 6, 7):
        offsets.started(0, offset)
    offsets.done(0, 6)
    assert offsets.committable() == {0: 5, 1: 9}
    offsets.done(0, 5)
    assert offsets.committable() == {0: 7, 1: 9}
    offsets.done(0, 7)
    assert offsets.committable() == {0: 8, 1: 9}
