"""A broker lost before the archive caught up (log/restore.py ``trainer_within_archive``): the trainer resumes
from its newest checkpoint whose buffer.groups offsets the archive holds; the newer ones are deleted, and a
trainer with no checkpoint the archive covers is refused, naming the offsets."""
from __future__ import annotations

import pytest
import torch

from milestream.log.restore import ReplayError, trainer_within_archive
from milestream.train import checkpoint


def _save(run_dir, step: int, offsets: dict[int, int]) -> None:
    state = checkpoint.TrainerState(step=step, version=step, offsets=offsets, seen_groups={f"g{step}"})
    checkpoint.save(run_dir, state, {"weight": torch.full((2,), float(step))}, keep=10)


def test_the_trainer_goes_back_to_the_newest_checkpoint_the_archive_covers(tmp_path):
    for step, offsets in ((1, {0: 2, 1: 1}), (2, {0: 3, 1: 2}), (3, {0: 5, 1: 2}), (4, {0: 6, 1: 4})):
        _save(tmp_path, step, offsets)
    position = trainer_within_archive(tmp_path, {0: 4, 1: 3})  # step 3 read offset 4 of partition 0: lost
    assert (position.step, position.offsets, position.seen_groups) == (2, {0: 3, 1: 2}, {"g2"})
    assert list(checkpoint.saved(tmp_path)) == [1, 2] and checkpoint.latest_step(tmp_path) == 2
    # covered now: nothing moves
    assert trainer_within_archive(tmp_path, {0: 4, 1: 3}).step == 2
    assert list(checkpoint.saved(tmp_path)) == [1, 2]


def test_no_checkpoint_covered_is_refused_and_no_checkpoint_is_a_fresh_start(tmp_path):
    assert trainer_within_archive(tmp_path, {}).step == 0
    _save(tmp_path, 1, {0: 2})
    with pytest.raises(ReplayError, match=r"\{0: \(2, 1\)\}"):
        trainer_within_archive(tmp_path, {0: 1})
    assert list(checkpoint.saved(tmp_path)) == [1]  # refused: nothing deleted
