"""A broker lost before the archive caught up (log/restore.py ``trainer_within_archive``): the trainer resumes
from its newest checkpoint the archive covers (its buffer.groups offsets and its step records archived); the
newer ones are deleted, and a trainer with no checkpoint the archive covers is refused, naming the offsets."""
from __future__ import annotations

import pytest
import torch
from archives import write_archive

from milestream.log.restore import ReplayError, trainer_within_archive
from milestream.schemas import topics
from milestream.schemas.records import Metrics
from milestream.train import checkpoint


def _save(run_dir, step: int, offsets: dict[int, int]) -> None:
    state = checkpoint.TrainerState(step=step, version=step, offsets=offsets, seen_groups={f"g{step}"})
    checkpoint.save(run_dir, state, {"weight": torch.full((2,), float(step))}, keep=10)


def _archive_steps(run_dir, steps: int) -> None:
    write_archive(run_dir, {topics.METRICS: [Metrics("trainer", s, 0.0, {"reward_mean": 0.0}, [f"g{s}"], [0])
                                             for s in range(1, steps + 1)]})


def test_the_trainer_goes_back_to_the_newest_checkpoint_the_archive_covers(tmp_path):
    for step, offsets in ((1, {0: 2, 1: 1}), (2, {0: 3, 1: 2}), (3, {0: 5, 1: 2}), (4, {0: 6, 1: 4})):
        _save(tmp_path, step, offsets)
    _archive_steps(tmp_path, 4)
    position = trainer_within_archive(tmp_path, {0: 4, 1: 3})  # step 3 read offset 4 of partition 0: lost
    assert (position.step, position.offsets, position.seen_groups) == (2, {0: 3, 1: 2}, {"g2"})
    assert list(checkpoint.saved(tmp_path)) == [1, 2] and checkpoint.latest_step(tmp_path) == 2
    # covered now: nothing moves
    assert trainer_within_archive(tmp_path, {0: 4, 1: 3}).step == 2
    assert list(checkpoint.saved(tmp_path)) == [1, 2]


def test_a_checkpoint_whose_step_record_the_archive_lacks_is_not_covered(tmp_path):
    """The archiver had the groups step 3 read but not yet the step's record: resumed at 3, the trainer would
    never write that record again and the run's lineage would miss step 3."""
    for step, offsets in ((1, {0: 1}), (2, {0: 2}), (3, {0: 3})):
        _save(tmp_path, step, offsets)
    _archive_steps(tmp_path, 2)
    assert trainer_within_archive(tmp_path, {0: 3}).step == 2
    assert list(checkpoint.saved(tmp_path)) == [1, 2]


def test_no_checkpoint_covered_is_refused_and_no_checkpoint_is_a_fresh_start(tmp_path):
    _archive_steps(tmp_path, 1)
    assert trainer_within_archive(tmp_path, {}).step == 0
    _save(tmp_path, 1, {0: 2})
    with pytest.raises(ReplayError, match=r"\{0: \(2, 1\)\}"):
        trainer_within_archive(tmp_path, {0: 1})
    assert list(checkpoint.saved(tmp_path)) == [1]  # refused: nothing deleted
