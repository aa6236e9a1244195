import dataclasses
import itertools

import numpy as np
import pytest

from milestream.schemas import routing
from milestream.schemas.records import LogProbs, Record, TeacherLogProbs, Trajectory, trajectory_id
from milestream.streams.filters import reward_nonzero_std
from milestream.streams.groups import (GroupAssembler, drop_record, join_sample, load_filter, oldest_version,
                                       record_positions, staleness)
from milestream.streams.sources import MismatchError, refs_of

_offsets = itertools.count()
LOG: dict[int, Record] = {}  # offset -> the record a ref made here points at


def ref(record: Record, partition: int = 0):
    """The record as the processor sees it: its ref, at the next offset of one partition."""
    offset = next(_offsets)
    LOG[offset] = record
    return refs_of([record], type(record), partition, offset, record.group_size)[0]


class Assembler(GroupAssembler):
    """Takes records: each becomes its ref first."""

    def add(self, record, handle=None):
        return super().add(ref(record), handle)


def joined(manifest):
    return [join_sample(row, [LOG[offset] for _, offset, _, _ in record_positions(row)]) for row in manifest]


def traj(group: str, i: int, size: int = 2, status: str = "completed", reward: float = 0.0, versions=(1, 2)):
    return Trajectory(f"{group}/{i}", group, "p", i, size, [1], [2, 3], [1, 1], list(versions), reward, status,
                      "", "e", "w", 0.0, 0.0)


def lp(group: str, i: int, size: int = 2):
    return LogProbs(f"{group}/{i}", group, i, size, [-0.1, -0.2])


def test_group_completes_only_with_every_trajectory_and_logprob_in_any_order():
    assembler = Assembler()
    assert assembler.add(lp("g", 1), "h1") == (None, True)
    assert assembler.add(traj("g", 0, reward=1.0), "h2") == (None, True)
    assert assembler.add(traj("g", 1), "h3") == (None, True)
    outcome, fresh = assembler.add(lp("g", 0), "h4")
    assert fresh and outcome.dropped is None
    assert [row.sample_index for row in outcome.manifest] == [0, 1]
    assert joined(outcome.manifest)[1].logprobs == pytest.approx([-0.1, -0.2])
    assert [row.reward for row in outcome.manifest] == [1.0, 0.0] and outcome.manifest[0].min_version == 1
    assert sorted(outcome.handles) == ["h1", "h2", "h3", "h4"]


def test_duplicates_are_ignored_before_and_after_completion():
    assembler = Assembler()
    assembler.add(traj("g", 0), 1)
    assert assembler.add(traj("g", 0), 2) == (None, False)
    assembler.add(traj("g", 1), 3)
    assembler.add(lp("g", 0), 4)
    outcome, _ = assembler.add(lp("g", 1), 5)
    assert outcome is not None and 2 not in outcome.handles
    assert assembler.add(traj("g", 1), 6) == (None, False)


def test_aborted_sample_drops_the_group_before_the_filter_runs():
    calls = []
    assembler = Assembler(group_filter=lambda s: calls.append(s) or (True, ""))
    for record in (traj("g", 0), traj("g", 1, status="aborted"), lp("g", 0), lp("g", 1)):
        outcome, _ = assembler.add(record)
    assert outcome.dropped.reason == "aborted" and "[1]" in outcome.dropped.detail
    assert calls == []


def test_a_failed_reward_drops_the_group_after_aborts_and_before_the_filter():
    calls = []
    assembler = Assembler(group_filter=lambda s: calls.append(s) or (True, ""))
    failed = dataclasses.replace(traj("g", 1), reward_error="TimeoutError: timed out after 30.0s")
    for record in (traj("g", 0), failed, lp("g", 0), lp("g", 1)):
        outcome, _ = assembler.add(record)
    assert (outcome.dropped.reason, outcome.dropped.detail) == ("reward_error",
                                                                "samples [1]: TimeoutError: timed out after 30.0s")
    assert calls == []
    assembler = Assembler()
    for record in (dataclasses.replace(failed, status="aborted"), traj("h", 0), lp("h", 0), lp("h", 1)):
        record = dataclasses.replace(record, group_id="h", trajectory_id=f"h/{record.sample_index}")
        outcome, _ = assembler.add(record)
    assert outcome.dropped.reason == "aborted"  # an aborted sample has no reward to speak of


def test_user_filter_rejects_with_its_reason():
    assembler = Assembler(group_filter=reward_nonzero_std)
    for record in (traj("g", 0, reward=1.0), traj("g", 1, reward=1.0), lp("g", 0), lp("g", 1)):
        outcome, _ = assembler.add(record)
    assert outcome.dropped.reason == "filtered" and "rewards equal 1.0" in outcome.dropped.detail


def test_pre_drop_uses_the_oldest_token_version():
    assembler = Assembler(max_staleness=2)
    assembler.latest_version = 4
    for record in (traj("g", 0, versions=(3, 4)), traj("g", 1, versions=(1, 4)), lp("g", 0), lp("g", 1)):
        outcome, _ = assembler.add(record)
    assert outcome.dropped.reason == "stale" and outcome.dropped.min_version == 1


def test_staleness_is_pessimistic():
    samples = [ref(traj("g", 0, versions=(5, 6))), ref(traj("g", 1, versions=(3, 6)))]
    assert oldest_version(samples) == 3
    assert staleness(samples, 6) == 3


def test_incomplete_groups_expire_with_a_reason():
    assembler = Assembler()
    assembler.add(traj("g", 0))
    (outcome,) = assembler.expire(assembler.overdue(older_than_s=-1))
    assert outcome.dropped.reason == "incomplete" and "1/2 trajectories" in outcome.dropped.detail
    assert assembler.add(traj("g", 1)) == (None, False)


def test_a_group_takes_the_outcome_an_earlier_processor_life_decided():
    assembler = Assembler(max_staleness=0)
    assembler.latest_version = 3
    for i in range(2):
        assembler.add(traj("g", i, versions=(1, 2)))
        outcome, _ = assembler.add(lp("g", i))
    assert outcome.drop_reason == "stale" and len(outcome.manifest) == 2  # a complete group keeps its manifest
    emitted = outcome.as_decided(None, 3)
    assert emitted.dropped is None and emitted.manifest == outcome.manifest
    filtered = emitted.as_decided("filtered", 3)
    assert (filtered.drop_reason, filtered.dropped.min_version, filtered.dropped.num_samples) == ("filtered", 1, 2)
    assert filtered.dropped.detail == "filtered, as an earlier life of the processor decided"
    assert outcome.as_decided("stale", 3) is outcome
    assembler.add(traj("h", 0))
    (incomplete,) = assembler.expire(assembler.overdue(older_than_s=-1))
    assert incomplete.manifest == [] and incomplete.as_decided("aborted", 3).drop_reason == "aborted"
    with pytest.raises(ValueError, match="incomplete here"):
        incomplete.as_decided(None, 3)  # the processor never expires a group an earlier life emitted


def test_filter_is_loaded_by_import_path():
    assert load_filter("milestream.streams.filters:reward_nonzero_std") is reward_nonzero_std
    assert load_filter("milestream.streams.filters.reward_nonzero_std") is reward_nonzero_std


def routed_traj(group: str, i: int, chunks: int, size: int = 2):
    return Trajectory(f"{group}/{i}", group, "p", i, size, [1], [2, 3], [1, 1], [1, 1], 0.0, "completed",
                      "", "e", "w", 0.0, 0.0, chunks)


def test_a_group_with_routing_waits_for_every_chunk_in_any_order_and_carries_them():
    ids = {i: np.arange(2 * 3 * 2).reshape(2, 3, 2) % 8 + i for i in range(2)}
    chunks = {i: routing.pack(f"g/{i}", "g", i, 2, ids[i], num_experts=16, chunk_tokens=1) for i in range(2)}
    assembler = Assembler()
    records = [chunks[1][1], lp("g", 0), routed_traj("g", 0, 2), chunks[0][0], routed_traj("g", 1, 2), lp("g", 1),
               chunks[1][0], chunks[1][1]]
    for record in records:
        outcome, _ = assembler.add(record)
        assert outcome is None  # chunk 0/1 of sample 0 is still missing
    assert assembler.add(chunks[0][0]) == (None, False)  # a duplicate chunk
    outcome, fresh = assembler.add(chunks[0][1])
    assert fresh and outcome.dropped is None
    assert [len(row.routing_offsets) for row in outcome.manifest] == [2, 2]
    for sample in joined(outcome.manifest):
        assert np.array_equal(routing.expert_ids(sample), ids[sample.sample_index])


def test_routing_that_contradicts_its_trajectory_is_refused_and_nothing_of_it_kept():
    assembler = Assembler()
    assembler.add(routed_traj("g", 0, chunks=1))
    extra = routing.pack("g/0", "g", 0, 2, np.zeros((4, 1, 1), dtype=int), num_experts=4, chunk_tokens=2)
    with pytest.raises(MismatchError) as caught:
        assembler.add(extra[0])
    assert caught.value.field == "num_chunks"
    assert not assembler.partial["g"].routing
    assembler.add(routed_traj("h", 0, chunks=3, size=5))
    with pytest.raises(MismatchError) as caught:
        assembler.add(routed_traj("h", 1, chunks=3, size=2))
    assert caught.value.field == "group_size"


def test_routing_packs_into_the_narrowest_width_and_round_trips():
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, size=(50, 4, 8))
    records = routing.pack("t", "g", 0, 1, small, num_experts=256, chunk_tokens=16)
    assert [r.chunk_index for r in records] == [0, 1, 2, 3] and {r.num_chunks for r in records} == {4}
    assert {r.id_bytes for r in records} == {1}
    fields = routing.joined_fields(records[::-1])
    unpacked = routing.unpack(fields["routing_layout"], fields["routing_compression"], fields["routing_data"])
    assert np.array_equal(unpacked, np.sort(small, axis=2))  # a token's experts are a set: kept sorted
    wide = rng.integers(0, 300, size=(5, 2, 2))
    assert routing.pack("t", "g", 0, 1, wide, num_experts=300)[0].id_bytes == 2
    with pytest.raises(ValueError):
        routing.pack("t", "g", 0, 1, wide, num_experts=256)


def test_a_group_lies_in_one_partition_and_a_record_elsewhere_is_refused():
    assembler = GroupAssembler()
    assembler.add(ref(traj("g", 0), partition=1))
    with pytest.raises(MismatchError) as caught:
        assembler.add(ref(traj("g", 1), partition=2))  # not keyed by its group id
    assert caught.value.field == "group_id" and len(assembler.partial["g"].trajectories) == 1
    assert [g.partition for g in assembler.forget({1})] == [1] and not assembler.partial


def test_a_record_that_breaks_a_rule_of_its_own_is_refused_before_any_group_sees_it():
    for record, field_name in ((dataclasses.replace(traj("g", 0), loss_mask=[1, 2]), "loss_mask"),
                               (dataclasses.replace(traj("g", 0), token_versions=[1]), "token_versions"),
                               (dataclasses.replace(traj("g", 0), status="pwned"), "status"),
                               (dataclasses.replace(traj("g", 0), reward=float("nan")), "reward"),
                               (dataclasses.replace(lp("g", 0), logprobs=[0.5, -0.1]), "logprobs"),
                               (dataclasses.replace(traj("g", 0), trajectory_id="h/0"), "trajectory_id")):
        with pytest.raises(MismatchError) as caught:
            ref(record)
        assert caught.value.field == field_name


def test_under_distillation_a_group_waits_for_its_teachers_logprobs_and_carries_them():
    assembler = Assembler(needs_teacher=True)
    teacher = [TeacherLogProbs(f"t/{i}", "t", i, 2, [-0.5 - i, -0.25], "teacher") for i in range(2)]
    for record in (traj("t", 0), lp("t", 0), traj("t", 1), lp("t", 1), teacher[1]):
        assert assembler.add(record) == (None, True)
    outcome, _ = assembler.add(teacher[0])
    assert outcome.dropped is None and all(row.teacher_offset >= 0 for row in outcome.manifest)
    assert [s.teacher_logprobs for s in joined(outcome.manifest)] == [[-0.5, -0.25], [-1.5, -0.25]]
    other = Assembler(needs_teacher=True)
    other.add(traj("u", 0))
    with pytest.raises(MismatchError, match="1 log-probs for 2 response tokens"):
        other.add(TeacherLogProbs("u/0", "u", 0, 2, [-1.0], "teacher"))


def test_without_distillation_teacher_records_are_not_waited_for():
    assembler = Assembler()
    for record in (traj("n", 0), lp("n", 0), traj("n", 1)):
        assembler.add(record)
    outcome, _ = assembler.add(lp("n", 1))
    assert outcome.dropped is None and [row.teacher_offset for row in outcome.manifest] == [-1, -1]
    assert [s.teacher_logprobs for s in joined(outcome.manifest)] == [[], []]


def leaf(group: str, i: int, number: int, leaves: int, reward: float = 1.0, size: int = 2):
    """Trajectory ``number`` of an agent's episode of ``leaves`` (sample ``i``), and its log-probs."""
    record = dataclasses.replace(traj(group, i, size, reward=reward), trajectory_id=trajectory_id(group, i, number),
                                 leaf=number, leaves=leaves)
    return record, dataclasses.replace(lp(group, i, size), trajectory_id=record.trajectory_id)


def test_an_episode_of_several_leaves_completes_with_every_leaf_and_counts_once():
    from milestream.train.collector import check_group, check_manifest

    assembler = Assembler()
    records = [*leaf("g", 0, 2, 3), *leaf("g", 1, 0, 1, reward=0.0), *leaf("g", 0, 0, 3), *leaf("g", 0, 1, 3)]
    outcomes = [assembler.add(record)[0] for record in records]
    assert outcomes[:-1] == [None] * (len(records) - 1)  # the last leaf's log-probs complete the group
    manifest = outcomes[-1].manifest
    assert [(row.sample_index, row.leaf, row.leaves) for row in manifest] == [(0, 0, 3), (0, 1, 3), (0, 2, 3),
                                                                               (1, 0, 1)]
    assert [row.trajectory_id for row in manifest] == ["g/0", "g/0.1", "g/0.2", "g/1"]
    check_manifest(manifest, 2, context=100, partitions=1)
    check_group(joined(manifest), 2, vocab_size=10, context=100)
    with pytest.raises(MismatchError, match=r"\[\(0, 0, 3\), \(0, 2, 3\), \(1, 0, 1\)\]"):  # leaf 1 missing
        check_manifest([manifest[0], *manifest[2:]], 2, context=100, partitions=1)
    # the episode's three trajectories and the other sample's one: each episode counts once
    assert drop_record("g", manifest, "filtered", "", "test", 0).mean_reward == pytest.approx(0.5)


def test_leaves_that_contradict_their_episode_or_their_id_are_refused():
    assembler = Assembler()
    assembler.add(leaf("g", 0, 0, 3)[0])
    with pytest.raises(MismatchError) as caught:
        assembler.add(leaf("g", 0, 1, 2)[0])  # its episode declared 3 leaves
    assert caught.value.field == "leaves"
    record = leaf("g", 0, 1, 3)[0]
    for bad, field_name in ((dataclasses.replace(record, leaf=2), "leaf"), (dataclasses.replace(record, leaves=1), "leaf"),
                            (dataclasses.replace(record, trajectory_id="g/0.01"), "trajectory_id"),
                            (dataclasses.replace(record, trajectory_id="g/0.x"), "trajectory_id")):
        with pytest.raises(MismatchError) as caught:
            ref(bad)
        assert caught.value.field == field_name, bad
    with pytest.raises(MismatchError) as caught:  # log-probs of a trajectory id no leaf makes
        ref(dataclasses.replace(lp("g", 0), trajectory_id="g/0.0"))
    assert caught.value.field == "trajectory_id"
