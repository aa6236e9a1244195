"""The disk transport: every version a full safetensors file in the run's shared folder.

The trainer writes the file atomically (temp + fsync + rename), then announces it with per-tensor
xxh64 checksums; an engine loads the file and verifies every checksum before applying it. The
disk-delta transport (delta.py) writes its full versions with the same helpers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Mapping

from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import (NO_BASE, VersionPruned, WeightVerificationError, checksum, checksums,
                                             cpu_tensors, verify, version_of, weights_dir, write_atomically)


def full_path(folder: Path, version: int) -> Path:
    return folder / f"v{version:06d}.safetensors"


def write_full(folder: Path, version: int, step: int, tensors: Mapping[str, Tensor]) -> tuple[Path, list[str], list[str]]:
    """Write a self-contained version; its checksums also go into the file, so a reader that meets
    it without the record (an engine catching up through a delta chain) can still verify it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = full_path(folder, version)
    cpu = cpu_tensors(tensors)
    names, sums = checksums(cpu)
    metadata = {"version": str(version), "step": str(step), "checksums": json.dumps(dict(zip(names, sums)))}
    write_atomically(path, lambda tmp: save_file(cpu, str(tmp), metadata=metadata))
    return path, names, sums


def read_full(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors of a full version file and its checksums by name (empty for older files)."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(str(path)), json.loads(metadata.get("checksums", "{}"))


def announce(producer: RecordProducer, version: int, step: int, transport: str, path: Path, base_version: int,
             names: list[str], sums: list[str], num_bytes: int) -> WeightVersion:
    record = WeightVersion(version=version, step=step, base_version=base_version, transport=transport,
                           location=str(path.resolve()), tensor_names=names, checksums=sums, num_bytes=num_bytes,
                           ts=time.time())
    producer.send(topics.WEIGHT_VERSIONS, [record])
    producer.flush()
    return record


def prune(folder: Path, keep_from: int) -> None:
    """Remove every version file (full or delta) older than ``keep_from``: engines lag by a version
    or two at most, and a late one catches up from what is kept."""
    for path in [*folder.glob("v*.safetensors"), *folder.glob("v*.delta")]:
        if version_of(path) < keep_from:
            path.unlink(missing_ok=True)


def nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class DiskSender:
    transport = "disk"

    def __init__(self, cfg: Config):
        self.folder = weights_dir(cfg.run.run_dir)
        self.keep = cfg.trainer.keep_weight_versions

    def publish(self, producer: RecordProducer, version: int, step: int,
                tensors: Mapping[str, Tensor]) -> WeightVersion:
        return publish_version(producer, self.folder.parent, version, step, tensors, keep=self.keep)

    def close(self) -> None:
        pass


class DiskReceiver:
    every_version = False  # each file is self-contained: only the newest matters

    def __init__(self, cfg: Config, engine_id: str):
        self.engine_id = engine_id

    def receive(self, record: WeightVersion) -> dict[str, Tensor]:
        return load_version(record)

    def close(self) -> None:
        pass


def publish_version(producer: RecordProducer, run_dir: str | Path, version: int, step: int,
                    tensors: Mapping[str, Tensor], keep: int = 3) -> WeightVersion:
    """Write ``tensors`` as version ``version``, then announce it on ``weights.versions``."""
    folder = weights_dir(run_dir)
    path, names, sums = write_full(folder, version, step, tensors)
    record = announce(producer, version, step, DiskSender.transport, path, NO_BASE, names, sums, nbytes(tensors))
    prune(folder, keep_from=version - keep + 1)
    return record


def read_verified_full(path: Path, version: int) -> dict[str, Tensor]:
    """A full version file's tensors, checked against the checksums written into it."""
    tensors, stored = read_full(path)
    actual = {name: checksum(tensor) for name, tensor in tensors.items()}
    bad = sorted(n for n in stored.keys() | actual.keys() if stored.get(n) != actual.get(n)) if stored else []
    if bad:
        raise WeightVerificationError(f"full version {version} at {path} fails its own checksums: {bad[:3]}")
    return tensors


def load_version(record: WeightVersion) -> dict[str, Tensor]:
    """The version's tensors, verified against the announced checksums."""
    try:
        tensors = load_file(record.location)
    except FileNotFoundError:
        path = Path(record.location)
        newest = max((version_of(p) for p in path.parent.glob("v*.safetensors")), default=-1)
        if newest > record.version and path.name == full_path(path.parent, record.version).name:
            raise VersionPruned(f"version {record.version}: {path} is gone, pruned (version {newest} is "
                                "there)") from None
        raise WeightVerificationError(f"version {record.version}: {path} is gone (pruned, or never "
                                      "written)") from None
    verify(record, tensors)
    return tensors
