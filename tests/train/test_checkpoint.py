"""Checkpoints are safetensors + JSON: a saved one restores bit for bit (weights, value head, optimizer,
RNG, offsets), and nothing planted where a checkpoint would be is ever unpickled.

The plant is a pickle whose loading creates a marker file, as any code in it could: put in place of
the old ``checkpoint.pt``, of ``tensors.safetensors`` (with the recorded sha256 left, or rewritten to
match), of ``checkpoint.json``, or pointed at by the manifest or the ``latest`` pointer. Every reader
(trainer and sft resume, replay, export) refuses each one with an error naming the file, and the
marker never appears.
"""
from __future__ import annotations

import hashlib
import json
import math
import pickle
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_learner import group

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.observe.recompute import checkpoint_before
from milestream.train import checkpoint
from milestream.train.checkpoint import CheckpointError, TrainerState
from milestream.train.export import version_tensors
from milestream.train.learner import Learner


class Bait:
    """Unpickling it opens its marker file for writing, which creates it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def baited(marker: Path) -> dict:
    return {"state": {"step": 2, "version": 2}, "backend": Bait(marker)}


@pytest.fixture
def bait(tmp_path: Path) -> tuple[dict, Path]:
    """(what a plant pickles, the marker its loading would create); its twin fires under the old loader."""
    twin = tmp_path / "twin"
    torch.save(baited(twin / "marker"), twin.with_suffix(".pt"))
    twin.mkdir()
    torch.load(twin.with_suffix(".pt"), weights_only=False)["backend"].close()
    assert (twin / "marker").exists()
    return baited(tmp_path / "marker"), tmp_path / "marker"


def small_state() -> dict:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)},
            "optimizer": {"state": {"w": {"step": torch.tensor(2.0), "exp_avg": torch.ones(2, 3)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "params": ["w"]}]}}


def saved_run(run_dir: Path) -> Path:
    return checkpoint.save(run_dir, TrainerState(step=2, version=2), small_state())


def legacy(run_dir: Path, planted: dict) -> None:
    folder = checkpoint.checkpoint_root(run_dir) / "step_000002"
    folder.mkdir(parents=True)
    torch.save(planted, folder / "checkpoint.pt")  # as the old checkpoints were written
    (folder.parent / "latest").write_text(folder.name)


def tensors_replaced(run_dir: Path, planted: dict) -> None:
    (saved_run(run_dir) / checkpoint.TENSORS).write_bytes(pickle.dumps(planted))


def tensors_replaced_checksum_rewritten(run_dir: Path, planted: dict) -> None:
    folder = saved_run(run_dir)
    (folder / checkpoint.TENSORS).write_bytes(pickle.dumps(planted))
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"][checkpoint.TENSORS]["sha256"] = hashlib.sha256(pickle.dumps(planted)).hexdigest()
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def manifest_replaced(run_dir: Path, planted: dict) -> None:
    (saved_run(run_dir) / checkpoint.MANIFEST).write_bytes(pickle.dumps(planted))


def manifest_points_elsewhere(run_dir: Path, planted: dict) -> None:
    folder = saved_run(run_dir)
    elsewhere = run_dir / "tool-output" / "evil.pt"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(pickle.dumps(planted))
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    digest = hashlib.sha256(elsewhere.read_bytes()).hexdigest()
    manifest["files"] = {f"../../tool-output/{elsewhere.name}": {"sha256": digest}}
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def pointer_points_elsewhere(run_dir: Path, planted: dict) -> None:
    root = saved_run(run_dir).parent
    (run_dir / "tool-output").mkdir()
    (run_dir / "tool-output" / "checkpoint.pt").write_bytes(pickle.dumps(planted))
    (root / "latest").write_text("../tool-output")


PLANTS: dict[str, tuple[Callable[[Path, dict], None], str]] = {
    "old checkpoint.pt": (legacy, r"step_000002/checkpoint\.pt: a pickle checkpoint of an older milestream, refused"),
    "pickle as tensors.safetensors": (tensors_replaced, r"tensors\.safetensors: sha256 \w+ differs from \w+ recorded"),
    "pickle as tensors.safetensors, checksum rewritten": (tensors_replaced_checksum_rewritten,
                                                          r"tensors\.safetensors: not a safetensors file"),
    "pickle as checkpoint.json": (manifest_replaced, r"checkpoint\.json: not JSON"),
    "manifest naming a file elsewhere": (manifest_points_elsewhere, r"checkpoint\.json names the files "
                                         r"\['\.\./\.\./tool-output/evil\.pt'\]"),
    "latest pointing elsewhere": (pointer_points_elsewhere,
                                  r"latest names '\.\./tool-output', not a checkpoint folder"),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_pickle_is_refused_and_never_runs(plant, bait, tmp_path):
    planted, marker = bait
    run_dir = tmp_path / "run"
    write, message = PLANTS[plant]
    write(run_dir, planted)
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load_latest(run_dir)
    assert not marker.exists()


def test_every_reader_refuses_an_old_pickle_checkpoint(bait, tmp_path):
    """The trainer and sft (load_latest), replay (checkpoint_before) and export (version_tensors)."""
    planted, marker = bait
    run_dir = tmp_path / "run"
    legacy(run_dir, planted)
    cfg = Config().with_overrides(model={"name": "tiny-random"}, run={"run_dir": str(run_dir)})
    for read in (lambda: checkpoint.load_latest(run_dir), lambda: checkpoint_before(run_dir, 5),
                 lambda: version_tensors(cfg, 2)):
        with pytest.raises(CheckpointError, match=r"checkpoint\.pt: a pickle checkpoint .* never unpickled"):
            read()
    assert not marker.exists()


def test_a_tampered_checksum_is_refused_naming_the_file(tmp_path):
    folder = saved_run(tmp_path)
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"][checkpoint.TENSORS]["sha256"] = "0" * 64
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    tensors = re.escape(str(folder / checkpoint.TENSORS))
    with pytest.raises(CheckpointError, match=rf"{tensors}: sha256 \w+ differs from 0{{64}} recorded"):
        checkpoint.load_latest(tmp_path)


def test_loading_never_unpickles(tmp_path, monkeypatch):
    saved_run(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled")
    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    payload = checkpoint.load_latest(tmp_path)
    assert equal(payload["backend"], small_state())


def test_any_state_dict_tree_round_trips_exactly(tmp_path):
    """dtypes, 0-d and empty tensors, views sharing storage, a transposed view, tuples, None, nan."""
    base = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    tree = {"model": {"a": base[:2], "b": base[2:], "t": base.t(), "bf16": base.bfloat16(), "empty": torch.zeros(0, 3),
                      "i64": torch.arange(5), "same": base},
            "optimizer": {"state": {"a": {"step": torch.tensor(7.0)}},
                          "param_groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None,
                                            "maximize": False, "nan": math.nan, "params": ["a", "b"]}]}}
    checkpoint.save(tmp_path, TrainerState(step=1), tree)
    back = checkpoint.load_latest(tmp_path)["backend"]
    assert equal(back, tree)
    assert isinstance(back["optimizer"]["param_groups"][0]["betas"], tuple)
    with pytest.raises(CheckpointError, match=r"backend/model/x: a set cannot go into a checkpoint"):
        checkpoint.save(tmp_path, TrainerState(step=2), {"model": {"x": {"a"}}})


def test_a_restored_checkpoint_takes_the_next_step_bit_for_bit(tmp_path):
    """PPO on LoRA: adapters, value head, AdamW moments and steps, torch's and Python's RNG, the state."""
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32"},
                                  trainer={"advantage_estimator": "ppo", "lam": 0.95, "lr": 1e-2})
    configure_process(cfg.model)
    batches = [[group("a", [1, 2, 3], [1.0, 0.0]), group("b", [4, 2], [0.0, 0.5])], [group("c", [7, 8], [0.2, 0.9])]]
    learner = Learner(cfg)
    learner.train_step(batches[0])
    state = TrainerState(step=1, version=1, offsets={0: 5, 3: 7}, seen_groups={"a", "b"})
    checkpoint.save(tmp_path, state, learner.state_dict())
    at_save = learner.state_dict()
    draws = torch.rand(4), random.random()
    figures = learner.train_step(batches[1])

    restored = Learner(cfg)
    payload = checkpoint.load_latest(tmp_path)
    restored.load_state_dict(payload["backend"])
    assert checkpoint.restore(payload) == state
    assert equal(restored.state_dict(), at_save)
    assert torch.equal(torch.rand(4), draws[0]) and random.random() == draws[1]
    assert restored.train_step(batches[1]) == figures
    assert equal(restored.state_dict(), learner.state_dict())


def equal(got, want) -> bool:
    """Same structure, types and values; tensors the same dtype, shape and bits."""
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(equal(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(equal, got, want))
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    return type(got) is type(want) and got == want
