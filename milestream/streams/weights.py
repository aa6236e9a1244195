"""Weight versions as events, with the disk transport: both halves in one module.

The trainer writes a version's tensors as safetensors into the run's shared folder (atomically:
temp file + rename) and publishes a ``WeightVersion`` carrying per-tensor xxh64 checksums. A rollout
engine loads the file, verifies every checksum before applying it, and acknowledges what it holds on
``weights.applied``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping

import torch
import xxhash
from safetensors.torch import load_file, save_file

from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import WeightApplied, WeightVersion


class WeightVerificationError(RuntimeError):
    pass


def checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh64(memoryview(raw)).hexdigest()


def checksums(tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    names = sorted(tensors)
    return names, [checksum(tensors[n]) for n in names]


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def publish_version(producer: RecordProducer, run_dir: str | Path, version: int, step: int,
                    tensors: Mapping[str, torch.Tensor], keep: int = 3) -> WeightVersion:
    """Write ``tensors`` as version ``version`` and announce it on ``weights.versions``."""
    folder = weights_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"v{version:06d}.safetensors"
    tmp = path.with_suffix(".tmp")
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    save_file(cpu, str(tmp), metadata={"version": str(version), "step": str(step)})
    os.replace(tmp, path)
    names, sums = checksums(cpu)
    record = WeightVersion(version=version, step=step, base_version=version - 1, transport="disk",
                           location=str(path.resolve()), tensor_names=names, checksums=sums,
                           num_bytes=sum(t.numel() * t.element_size() for t in cpu.values()), ts=time.time())
    producer.send(topics.WEIGHT_VERSIONS, [record])
    producer.flush()
    _prune(folder, keep_from=version - keep + 1)
    return record


def _prune(folder: Path, keep_from: int) -> None:
    # Engines lag by a version or two at most; older files are never read again.
    for path in folder.glob("v*.safetensors"):
        if int(path.stem[1:]) < keep_from:
            path.unlink(missing_ok=True)


def load_version(record: WeightVersion) -> dict[str, torch.Tensor]:
    """The version's tensors, verified against the announced checksums."""
    tensors = load_file(record.location)
    names, sums = checksums(tensors)
    if names != list(record.tensor_names):
        missing = sorted(set(record.tensor_names) - set(names))
        extra = sorted(set(names) - set(record.tensor_names))
        raise WeightVerificationError(f"version {record.version}: missing tensors {missing[:5]}, unexpected {extra[:5]}")
    bad = [n for n, got, want in zip(names, sums, record.checksums) if got != want]
    if bad:
        raise WeightVerificationError(f"version {record.version}: checksum mismatch on {len(bad)} tensors, e.g. {bad[:3]}")
    return tensors


def acknowledge(producer: RecordProducer, engine_id: str, record: WeightVersion,
                tensors: Mapping[str, torch.Tensor] | None, error: str = "") -> WeightApplied:
    names, sums = checksums(tensors) if tensors is not None else ([], [])
    ack = WeightApplied(engine_id=engine_id, version=record.version, tensor_names=names, checksums=sums,
                        ok=not error, detail=error, ts=time.time())
    producer.send(topics.WEIGHTS_APPLIED, [ack], key=engine_id)
    return ack
