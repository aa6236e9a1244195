"""The lineage rules and the audit over a log written straight to archive segments (no broker):
a redone step's later record wins, a group's first drop wins, fates against the trainer's checkpoint,
and an audit that fails a group both trained and dropped; the reader's bad-record policies."""
from __future__ import annotations

import pytest
from archives import write_archive

from milestream.log.audit import audit_run
from milestream.log.lineage import BUFFERED, DROPPED, LOST, TRAINED, Lineage, lineage_of
from milestream.log.reader import SkipBadRecords, read_archive
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Dropped, GroupManifest, Metrics, Record
from milestream.train.checkpoint import TrainerState


def step(number: int, groups: list[str], ts: float = 0.0) -> Metrics:
    return Metrics("trainer", number, ts, {"reward_mean": 0.0}, groups, [0] * len(groups))


def drop(group_id: str, reason: str, by: str = "processor") -> Dropped:
    return Dropped(group_id, group_id.split("#")[0], reason, "", by, 2, 0, 0, 0.0, 0.0)


def sample(group_id: str) -> GroupManifest:
    return GroupManifest(f"{group_id}/0", group_id, group_id.split("#")[0], 0, 1, 0.0, "completed", "e", "w", 0.0, 0.0,
                         1, 1, 0, 0, 0, 0, 0, 0, 0, [], [])


def observed(*records: Record) -> Lineage:
    lineage = Lineage()
    for offset, record in enumerate(records):
        lineage.observe(record, Position("any", 0, offset))
    return lineage


def test_a_redone_steps_later_record_wins():
    lineage = observed(step(1, ["a#0"]), step(2, ["b#0"]), step(2, ["c#0"]), step(3, ["d#0"]))
    assert [m.group_ids for m in lineage.trainer_steps()] == [["a#0"], ["c#0"], ["d#0"]]
    assert lineage.step_records == 4 and lineage.missing_steps() == []
    assert observed(step(1, ["a#0"]), step(3, ["b#0"])).missing_steps() == [2]


def test_a_groups_first_drop_wins():
    lineage = observed(drop("a#0", "stale", "processor"), drop("a#0", "stale", "trainer"), drop("b#0", "filtered"))
    assert lineage.drops["a#0"].dropped_by == "processor"
    assert lineage.drop_reasons() == {"stale": 1, "filtered": 1}


def test_fates_against_the_trainers_checkpoint():
    lineage = observed(sample("t#0"), sample("d#0"), sample("seen#0"), sample("old#0"), sample("new#0"),
                       step(1, ["t#0"]), drop("d#0", "stale", "trainer"))
    trainer = TrainerState(offsets={0: 4}, seen_groups={"t#0", "d#0", "seen#0"})
    outcomes = {g: fate.outcome for g, fate in lineage.fates(trainer).items()}
    assert outcomes == {"t#0": TRAINED, "d#0": DROPPED, "seen#0": LOST, "old#0": LOST, "new#0": BUFFERED}
    assert lineage.fates()["old#0"].outcome == BUFFERED  # no checkpoint: every group without an outcome waits
    assert lineage.fates()["t#0"].step == 1 and lineage.fates()["new#0"].emitted_at == (0, 4)
    no_figures = observed(Metrics("trainer", 1, 0.0, {}, ["x#0"])).fates()["x#0"]  # no staleness: still trained
    assert (no_figures.outcome, no_figures.staleness) == (TRAINED, None)


def test_audit_fails_a_group_both_trained_and_dropped(tmp_path):
    write_archive(tmp_path, {
        topics.GROUPS: [sample("a#0"), sample("b#0"), sample("c#0")],
        topics.METRICS: [step(1, ["a#0", "b#0"])],
        topics.DROPPED: [drop("b#0", "stale", "trainer"), drop("c#0", "stale", "trainer")],
    })
    audit = audit_run(tmp_path)
    assert audit.groups_trained_and_dropped == ["b#0"] and not audit.exact
    assert (audit.groups_trained, audit.groups_dropped, audit.groups_lost) == (2, 1, [])

    clean = tmp_path / "clean"
    write_archive(clean, {topics.GROUPS: [sample("a#0"), sample("c#0")], topics.METRICS: [step(1, ["a#0"])],
                          topics.DROPPED: [drop("c#0", "stale", "trainer")]})
    assert audit_run(clean).exact


def test_a_bad_record_raises_or_is_skipped_and_counted(tmp_path):
    write_archive(tmp_path, {topics.METRICS: [step(1, ["a#0"]), b"not arrow", step(2, ["b#0"])]})
    with pytest.raises(RecordError, match=r"buffer\.metrics\[0\]@1: field '<value>'"):
        list(read_archive(tmp_path, topics.METRICS))
    skip = SkipBadRecords()
    messages = list(read_archive(tmp_path, topics.METRICS, skip))
    assert [m.offset for m in messages] == [0, 2] and skip.skipped == 1
    assert messages[1].timestamp_ms == 1002 and lineage_of(messages).missing_steps() == []
