"""The weight-transport interface both halves implement, and what every transport shares.

A trainer-side ``WeightSender`` (rank 0 talks to Kafka) delivers a version's tensors and announces
it on ``weights.versions``; an engine-side ``WeightReceiver`` turns each announced ``WeightVersion``
back into the full tensors of that version, verified against the record's per-tensor checksums.
The transports differ only in how the bytes travel (a file, a file of changed bytes, a broadcast,
point-to-point writes); ``make_sender`` / ``make_receiver`` pick one by ``cfg.weights.transport``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import xxhash

from milestream.config import Config, import_path
from milestream.infra.kafka import RecordProducer
from milestream.schemas import topics
from milestream.schemas.records import WeightApplied, WeightVersion
from milestream.streams.versions import NO_BASE, weights_dir  # noqa: F401 - where the transports find them

if TYPE_CHECKING:  # the verifier and the processor read versions without torch
    from torch import Tensor

# name -> import path of (sender class, receiver class); imported only when chosen, so a transport's
# dependencies (torch.distributed groups, ucxx) cost nothing to the others
TRANSPORTS: dict[str, tuple[str, str]] = {
    "disk": ("milestream.streams.weights.disk:DiskSender", "milestream.streams.weights.disk:DiskReceiver"),
    "disk-delta": ("milestream.streams.weights.delta:DeltaSender", "milestream.streams.weights.delta:DeltaReceiver"),
    "broadcast": ("milestream.streams.weights.broadcast:BroadcastSender",
                  "milestream.streams.weights.broadcast:BroadcastReceiver"),
    "p2p": ("milestream.streams.weights.p2p:P2PSender", "milestream.streams.weights.p2p:P2PReceiver"),
}


class WeightVerificationError(RuntimeError):
    """Delivered tensors differ from the announced version (checksum, name, or a missing piece)."""


class VersionPruned(WeightVerificationError):
    """The version's file is gone and a newer version's file is beside it: the trainer pruned it on moving on
    (``trainer.keep_weight_versions``). An engine passes it over for the newer one; no fault of the record, so
    it is neither refused on ``weights.applied`` nor dead-lettered."""


class WeightSender(Protocol):
    """Trainer side, rank 0. Built as ``Sender(cfg)``."""

    transport: str

    def publish(self, producer: RecordProducer, version: int, step: int,
                tensors: Mapping[str, Tensor]) -> WeightVersion:
        """Deliver the bytes and put the WeightVersion on weights.versions (the transport decides the
        order: broadcast must announce first and then send; disk writes first and then announces).
        ``tensors`` may be views of live parameters: a sender that keeps them must copy."""

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Engine side, one per rollout engine. Built as ``Receiver(cfg, engine_id)``.

    ``every_version``: True when the receiver takes part in each version's delivery (a collective),
    so ``receive`` must be called for every announced version, in order; False when only the newest
    matters and older announcements may be skipped.
    """

    every_version: bool

    def receive(self, record: WeightVersion) -> dict[str, Tensor]:
        """Full, verified tensors of record.version (raises WeightVerificationError on a mismatch).
        Called off the event loop while the engine keeps generating; the result is not mutated later."""

    def close(self) -> None: ...


def make_sender(cfg: Config) -> WeightSender:
    sender_path, _ = _transport(cfg)
    return import_path(sender_path, "weights.transport")(cfg)


def make_receiver(cfg: Config, engine_id: str) -> WeightReceiver:
    _, receiver_path = _transport(cfg)
    return import_path(receiver_path, "weights.transport")(cfg, engine_id)


def _transport(cfg: Config) -> tuple[str, str]:
    try:
        return TRANSPORTS[cfg.weights.transport]
    except KeyError:
        raise ValueError(f"weights.transport {cfg.weights.transport!r} is not one of {sorted(TRANSPORTS)}") from None


# ---- checksums -------------------------------------------------------------------------------------

def checksum(tensor: Tensor) -> str:
    """xxh64 of the tensor's raw bytes (dtype and layout as stored, so a cast is a mismatch)."""
    import torch

    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh64(memoryview(raw)).hexdigest()


def checksums(tensors: Mapping[str, Tensor]) -> tuple[list[str], list[str]]:
    names = sorted(tensors)
    return names, [checksum(tensors[n]) for n in names]


def checksum_mismatches(expected_names: list[str], expected: list[str], names: list[str],
                        sums: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, differing) tensor names between an announced and a held set."""
    want, got = dict(zip(expected_names, expected)), dict(zip(names, sums))
    missing = sorted(want.keys() - got.keys())
    unexpected = sorted(got.keys() - want.keys())
    differing = sorted(n for n in want.keys() & got.keys() if want[n] != got[n])
    return missing, unexpected, differing


def verify(record: WeightVersion, tensors: Mapping[str, Tensor]) -> None:
    """Raise WeightVerificationError unless ``tensors`` are exactly the announced version."""
    names, sums = checksums(tensors)
    missing, unexpected, differing = checksum_mismatches(list(record.tensor_names), list(record.checksums),
                                                          names, sums)
    if missing or unexpected:
        raise WeightVerificationError(f"version {record.version}: missing tensors {missing[:5]}, "
                                      f"unexpected {unexpected[:5]}")
    if differing:
        raise WeightVerificationError(f"version {record.version}: checksum mismatch on {len(differing)} "
                                      f"tensors, e.g. {differing[:3]}")


def acknowledge(producer: RecordProducer, engine_id: str, record: WeightVersion,
                tensors: Mapping[str, Tensor] | None, error: str = "") -> WeightApplied:
    """Tell ``weights.applied`` what the engine now holds (checksums), or why it refused the version."""
    names, sums = checksums(tensors) if tensors is not None else ([], [])
    ack = WeightApplied(engine_id=engine_id, version=record.version, tensor_names=names, checksums=sums,
                        ok=not error, detail=error, ts=time.time())
    producer.send(topics.WEIGHTS_APPLIED, [ack], key=engine_id)
    return ack


# ---- files -----------------------------------------------------------------------------------------

def cpu_tensors(tensors: Mapping[str, Tensor], copy: bool = False) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors; ``copy``: never sharing memory with the originals."""
    out = {}
    for name, tensor in tensors.items():
        cpu = tensor.detach().cpu().contiguous()
        out[name] = cpu.clone() if copy and cpu.data_ptr() == tensor.data_ptr() else cpu
    return out


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(temp)``, fsync, rename over ``path``, fsync the folder: a reader sees the whole file
    or none, even after a crash (a rename is only durable once its directory entry is)."""
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def version_of(path: Path) -> int:
    """``v000012.safetensors`` / ``v000012.delta`` -> 12."""
    return int(path.name[1:].split(".", 1)[0])


def engine_weights_dir(run_dir: str | Path) -> Path:
    """Where a client of HTTP engines (``HttpEngine``) stages the versions they load: RUN_DIR/engine-weights."""
    return Path(run_dir) / "engine-weights"


def in_weight_folders(path: Path, run_dir: str | Path) -> Path | None:
    """``path`` with every symlink resolved, if it lies in one of the run's weight folders (RUN_DIR/weights,
    RUN_DIR/engine-weights, resolved too); else None."""
    real = Path(path).resolve()
    folders = (weights_dir(run_dir).resolve(), engine_weights_dir(run_dir).resolve())
    return real if any(real.is_relative_to(folder) for folder in folders) else None
