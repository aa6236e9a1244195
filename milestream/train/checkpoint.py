"""Trainer checkpoints: model, optimizer, RNG and the consumed offsets, written atomically together.

The offsets live inside the checkpoint (not in the broker's group offsets) so that model state and
log position can never disagree: a resumed trainer seeks to exactly where its weights left off.
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from milestream.infra import faults


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # buffer.groups partition -> next offset
    seen_groups: set[str] = field(default_factory=set)  # trained or dropped: a re-emitted group is skipped


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: str | Path, state: TrainerState, learner_state: dict, keep: int = 2) -> Path:
    """``learner_state``: the backend's state_dict (weights and optimizer state by parameter name)."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".step_{state.step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({
        "backend": learner_state,
        "state": {"step": state.step, "version": state.version, "offsets": dict(state.offsets),
                  "seen_groups": sorted(state.seen_groups)},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }, tmp / "checkpoint.pt")
    faults.hold("trainer.checkpoint_written")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_latest(root, final.name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / "latest")


def load_latest(run_dir: str | Path) -> dict | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    return torch.load(pointer.parent / pointer.read_text().strip() / "checkpoint.pt", weights_only=False)


def latest_step(run_dir: str | Path) -> int:
    """The step of the newest checkpoint (0: none yet)."""
    pointer = checkpoint_root(run_dir) / "latest"
    return int(pointer.read_text().strip().split("_")[1]) if pointer.exists() else 0


def restore(payload: dict) -> TrainerState:
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    state = payload["state"]
    return TrainerState(state["step"], state["version"], {int(k): v for k, v in state["offsets"].items()},
                        set(state["seen_groups"]))
