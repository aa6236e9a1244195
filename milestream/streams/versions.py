"""What a reader takes from weights.versions and weights.applied, free of torch (the processor reads versions).

A version is announced by the run's trainer alone: never past the newest version it told the ledger of
(``BufferLedger.trainer_version``), over the run's transport, with one xxh64 per tensor and, for the disk
transports, a file of that version in the run's weights folder; for the others, a rendezvous at
``weights.sender_host`` (a forged record sends no engine to another machine). An acknowledgement comes
from a named engine, with its checksums, or a refusal that says why. A record that breaks a rule raises
RecordError naming its field, and its reader dead-letters it.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from milestream.config import Config
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import WeightApplied, WeightVersion
from milestream.streams.ledger import BufferLedger

NO_BASE = -1  # WeightVersion.base_version of a self-contained (full) version
DISK_TRANSPORTS = ("disk", "disk-delta")  # a version is a file in the run's weights folder
_XXH64 = re.compile(r"[0-9a-f]{16}")


def weights_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "weights"


def check_version(cfg: Config, record: WeightVersion, position: Position, trainer_version: int | None) -> None:
    """Raise RecordError naming the field of an announcement the run's trainer did not make: a version past
    the newest it announced (``BufferLedger.trainer_version``; None: unknown, no bound), another transport,
    a file outside the run's weights folder, a rendezvous at another host than weights.sender_host, checksums
    that are not one xxh64 per tensor."""
    def bad(field: str, reason: str) -> RecordError:
        return RecordError(position, field, reason)

    if record.version < 0 or (trainer_version is not None and record.version > trainer_version):
        raise bad("version", f"version {record.version}; the trainer has announced up to {trainer_version}")
    if record.step < 0 or not math.isfinite(record.ts) or record.num_bytes < 0:
        raise bad("step", f"step {record.step}, ts {record.ts}, num_bytes {record.num_bytes}")
    if record.base_version != NO_BASE and not 0 <= record.base_version < record.version:
        raise bad("base_version", f"base version {record.base_version} of version {record.version}")
    if record.transport != cfg.weights.transport:
        raise bad("transport", f"{record.transport!r}; the run's weights.transport is {cfg.weights.transport!r}")
    _check_checksums(record.tensor_names, record.checksums, bad)
    if record.transport in DISK_TRANSPORTS:
        folder, path = weights_dir(cfg.run.run_dir).resolve(), Path(record.location)
        named = re.fullmatch(rf"v{record.version:06d}\.(safetensors|delta)", path.name)
        if not path.is_absolute() or path.parent != folder or ".." in path.parts or not named:
            raise bad("location", f"{record.location!r} is not version {record.version}'s file in {folder}")
    elif _host(record.location) != cfg.weights.sender_host.lower():
        raise bad("location", f"{record.location!r}: the rendezvous of the run's trainer is at "
                              f"weights.sender_host {cfg.weights.sender_host!r}, not there")


def _host(location: str) -> str | None:
    """The host of a rendezvous address ``scheme://host:port/...`` (lower case), None when it has none."""
    try:
        return urlsplit(location).hostname
    except ValueError:
        return None


def version_check(cfg: Config, ledger: BufferLedger) -> Callable[[list[WeightVersion], Position], None]:
    """A ``RecordConsumer`` check of weights.versions: ``check_version`` against the trainer's version now."""
    def check(records: list[WeightVersion], position: Position) -> None:
        trainer_version = ledger.trainer_version()
        for record in records:
            check_version(cfg, record, position, trainer_version)
    return check


def check_applied(record: WeightApplied, position: Position) -> None:
    """Raise RecordError naming the field of an acknowledgement no engine writes."""
    def bad(field: str, reason: str) -> RecordError:
        return RecordError(position, field, reason)

    if not record.engine_id or not record.engine_id.isprintable():
        raise bad("engine_id", f"engine id {record.engine_id!r}")
    if record.version < 0 or not math.isfinite(record.ts):
        raise bad("version", f"version {record.version}, ts {record.ts}")
    if record.ok:
        _check_checksums(record.tensor_names, record.checksums, bad)
    elif not record.detail or record.tensor_names or record.checksums:
        raise bad("detail", "a refusal says why and holds no checksums")


def _check_checksums(names: list[str], sums: list[str], bad: Callable[[str, str], RecordError]) -> None:
    if not names or len(set(names)) != len(names) or not all(names):
        raise bad("tensor_names", f"{len(names)} tensor names, {len(set(names))} distinct, none empty expected")
    if len(sums) != len(names) or not all(_XXH64.fullmatch(s) for s in sums):
        raise bad("checksums", f"{len(sums)} checksums for {len(names)} tensors, each 16 hex digits expected")
