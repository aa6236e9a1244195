"""Trainer checkpoints: model, optimizer, RNG and the consumed offsets, written atomically together.

The offsets live inside the checkpoint (not in the broker's group offsets) so that model state and
log position can never disagree: a resumed trainer seeks to exactly where its weights left off.

A checkpoint is a folder ``RUN_DIR/checkpoints/step_NNNNNN`` of two files:

    tensors.safetensors  every tensor: weights, the value head, optimizer moments and steps, torch's RNG
    checkpoint.json      everything else: step, version, offsets, seen groups, the optimizer's
                         hyper-parameters, Python's RNG state, where each tensor of the backend's
                         state_dict goes, and the sha256 of tensors.safetensors

Nothing in a checkpoint is unpickled: loading a pickle runs whatever code it names, and tool code
the policy writes can reach the run folder. The tensor file is checked against its sha256 before
it is read; a pickle checkpoint of an older milestream (``checkpoint.pt``) is refused, never read.
Every reader of checkpoints (trainer, sft, replay, export, audit) goes through this module.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from milestream.infra import faults

FORMAT = 1
MANIFEST = "checkpoint.json"
TENSORS = "tensors.safetensors"
LEGACY = "checkpoint.pt"  # the pickle of milestream before FORMAT 1
_FOLDER = re.compile(r"step_(\d{6,})")
# JSON stand-ins for what JSON lacks; a state_dict key starting with "$" is refused on save
_TENSOR, _TUPLE = "$tensor", "$tuple"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read: refused, nothing loaded from it."""


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
    _write(tmp, state, learner_state)
    faults.hold("trainer.checkpoint_written")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_latest(root, final.name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(folder: Path, state: TrainerState, learner_state: dict) -> None:
    tensors: dict[str, Tensor] = {}
    version, internal, gauss_next = random.getstate()
    manifest = {
        "format": FORMAT,
        "state": {"step": state.step, "version": state.version,
                  "offsets": {str(p): o for p, o in sorted(state.offsets.items())},
                  "seen_groups": sorted(state.seen_groups)},
        "rng": {"torch": _encode(torch.get_rng_state(), "rng/torch", tensors),
                "python": {"version": version, "internal_state": list(internal), "gauss_next": gauss_next}},
        "backend": _encode(learner_state, "backend", tensors),
    }
    path = folder / TENSORS
    save_file(_packed(tensors), str(path))
    manifest["files"] = {TENSORS: {"sha256": _sha256(path), "bytes": path.stat().st_size}}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _write_latest(root: Path, name: str) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(name)
    os.replace(tmp, root / "latest")


def saved(run_dir: str | Path) -> dict[int, Path]:
    """Every checkpoint folder of the run by step, oldest first (``load`` refuses those it cannot trust)."""
    found = {int(m.group(1)): p for p in checkpoint_root(run_dir).glob("step_*")
             if (m := _FOLDER.fullmatch(p.name)) and p.is_dir()}
    return dict(sorted(found.items()))


def saved_offsets(folder: str | Path) -> dict[int, int]:
    """The buffer.groups offsets a checkpoint resumes from, from its manifest alone (its tensors unread)."""
    manifest_path = Path(folder) / MANIFEST
    try:
        offsets = json.loads(manifest_path.read_text())["state"]["offsets"]
        return {int(p): int(o) for p, o in offsets.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{manifest_path}: no readable offsets ({type(exc).__name__}: {exc})") from None


def roll_back(run_dir: str | Path, step: int) -> list[int]:
    """Make the checkpoint of ``step`` (0: none, a fresh start) the latest and delete every newer one; returns
    the steps deleted. For a resume whose log lost what the newer checkpoints had trained (log/restore.py)."""
    root = checkpoint_root(run_dir)
    newer = [s for s in saved(run_dir) if s > step]
    if step:
        _write_latest(root, f"step_{step:06d}")
    else:
        (root / "latest").unlink(missing_ok=True)
    for s in newer:
        shutil.rmtree(root / f"step_{s:06d}")
    return newer


def load_latest(run_dir: str | Path) -> dict | None:
    """The newest checkpoint (``load``), None when the run has none yet."""
    name = _latest_name(run_dir)
    return None if name is None else load(checkpoint_root(run_dir) / name)


def latest_step(run_dir: str | Path) -> int:
    """The step of the newest checkpoint (0: none yet)."""
    name = _latest_name(run_dir)
    return 0 if name is None else int(name.split("_")[1])


def _latest_name(run_dir: str | Path) -> str | None:
    pointer = checkpoint_root(run_dir) / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not _FOLDER.fullmatch(name):  # a pointer out of the checkpoints folder is no checkpoint of this run
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a checkpoint folder step_NNNNNN; nothing loaded")
    return name


def load(folder: str | Path) -> dict:
    """{"state", "rng", "backend"} of the checkpoint in ``folder``, its tensor file verified first.

    Raises ``CheckpointError`` for a pickle checkpoint, a tensor file that fails its sha256, or a
    malformed manifest; nothing is unpickled whatever the folder holds.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        legacy = folder / LEGACY
        if legacy.exists():
            raise CheckpointError(
                f"{legacy}: a pickle checkpoint of an older milestream, refused: loading a pickle runs any "
                f"code it names, so checkpoints are now {TENSORS} + {MANIFEST} and are never unpickled. "
                f"Nothing was loaded; start from a fresh run folder, or move {folder} away")
        raise CheckpointError(f"{folder}: not a checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: not JSON ({exc}); nothing loaded") from None
    try:
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, this milestream reads "
                                  f"format {FORMAT}; nothing loaded")
        tensors = _verified_tensors(folder, manifest["files"], manifest_path)
        python = manifest["rng"]["python"]
        return {"state": manifest["state"],
                "rng": {"torch": _decode(manifest["rng"]["torch"], tensors),
                        "python": (python["version"], tuple(python["internal_state"]), python["gauss_next"])},
                "backend": _decode(manifest["backend"], tensors)}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{manifest_path}: malformed ({type(exc).__name__}: {exc}); nothing loaded") from None


def _verified_tensors(folder: Path, files: dict, manifest_path: Path) -> dict[str, Tensor]:
    if set(files) != {TENSORS}:  # a manifest naming another file (elsewhere) is not one this module wrote
        raise CheckpointError(f"{manifest_path} names the files {sorted(files)[:4]}; a checkpoint holds "
                              f"{TENSORS} alone, in its own folder; nothing loaded")
    path = folder / TENSORS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; nothing loaded")
    expected, actual = files[TENSORS]["sha256"], _sha256(path)
    if actual != expected:
        raise CheckpointError(f"{path}: sha256 {actual} differs from {expected} recorded in {manifest_path}: "
                              f"changed or damaged since the checkpoint was written; nothing loaded")
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc}); nothing loaded") from None


def restore(payload: dict) -> TrainerState:
    """The trainer state of a loaded checkpoint; sets torch's and Python's RNG as they were at the save."""
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    state = payload["state"]
    return TrainerState(state["step"], state["version"], {int(k): v for k, v in state["offsets"].items()},
                        set(state["seen_groups"]))


def _encode(value: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` under their path in ``value``."""
    if isinstance(value, Tensor):
        if path in tensors:
            raise CheckpointError(f"two tensors of the checkpoint at {path}")
        tensors[path] = value
        return {_TENSOR: path}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str) or k.startswith("$")]
        if bad:
            raise CheckpointError(f"{path}: keys {bad[:3]} cannot go into a checkpoint "
                                  f"(str keys, none starting with $)")
        return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"{path}: a {type(value).__name__} cannot go into a checkpoint (tensors, numbers, "
                          f"strings, None, lists, tuples and dicts of them)")


def _decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    return {k: _decode(v, tensors) for k, v in value.items()}


def _packed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """On the CPU, contiguous, none sharing memory with another (safetensors refuses shared storage)."""
    packed, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        storages.add(storage)
        packed[name] = tensor
    return packed


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
