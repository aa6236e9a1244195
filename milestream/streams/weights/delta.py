"""The disk-delta transport: only the bytes that changed since the base version, both halves.

Trainer side: the sender keeps the tensors of the version it published last (its base) and writes
each new version as a delta against it; the first version, and every ``weights.full_every``-th after
the last full one, is a full safetensors file (disk.py) so that an engine that missed deltas can
catch up. A delta file is

    MAGIC | u64 header length | header (JSON) | one zstd frame per changed tensor

where the header holds version, base version, step and, per tensor, its dtype, shape, the xxh64 of
the full new tensor and how it is encoded:

    same    unchanged: no payload
    sparse  flat positions of the changed elements (as gaps, in the narrowest unsigned type that
            holds them) + the changed elements xor the base's (new value = base xor that)
    xor     the new raw bits xor the base's, for every element (mostly zero where little changed)
    raw     the new tensor's bytes (a tensor that is new, or changed shape or dtype)

Changes are found on the raw bits, so -0.0, NaN payloads and bf16 rounding are all exact. With
``delta_encoding=sparse`` a tensor whose positions would cost more than its xor falls back to xor.
Both payloads are stored byte plane by byte plane (all first bytes, then all second bytes, ...),
which roughly halves what zstd makes of them: a small change leaves the high bytes zero.

Engine side: the receiver applies the chain of deltas from the version it holds (or from the
nearest full version) on copies, in the caller's worker thread while the engine keeps generating,
and verifies every tensor's checksum; the engine pauses only to copy the result in.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import zstandard
from torch import Tensor

from milestream.config import Config
from milestream.infra.kafka import RecordProducer
from milestream.schemas.records import WeightVersion
from milestream.streams.weights.base import (NO_BASE, WeightVerificationError, checksum, checksums, cpu_tensors,
                                             verify, version_of, weights_dir, write_atomically)
from milestream.streams.weights.disk import announce, full_path, nbytes, prune, read_verified_full, write_full

MAGIC = b"MSWDELTA"
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # an integer view of each element width
_LENGTH = struct.Struct("<Q")


def delta_path(folder: Path, version: int) -> Path:
    return folder / f"v{version:06d}.delta"


# ---- encoding --------------------------------------------------------------------------------------

def _bits(tensor: Tensor) -> np.ndarray:
    """The tensor's elements as same-width integers (numpy has no bfloat16; bits need none)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().view(_BITS[tensor.element_size()])


def _from_bits(bits: np.ndarray, dtype: torch.dtype, shape: list[int]) -> Tensor:
    return torch.from_numpy(bits.view(np.uint8)).view(dtype).reshape(shape)


def _planes(values: np.ndarray) -> bytes:
    """The bytes of every element's first byte, then of every second byte, ...: the high bytes of
    small changes are mostly zero, and zstd packs long runs of them far better than interleaved."""
    return values.view(np.uint8).reshape(-1, values.itemsize).T.tobytes()


def _unplanes(raw: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(dtype.itemsize, -1).T.copy().view(dtype).reshape(-1)


def _gap_type(largest: int) -> np.dtype:
    return np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if largest <= np.iinfo(t).max))


def encode_tensor(base: Tensor | None, new: Tensor, encoding: str) -> tuple[str, bytes]:
    """(kind, uncompressed payload) of ``new`` against ``base``."""
    if base is None or base.shape != new.shape or base.dtype != new.dtype:
        return "raw", _bits(new).tobytes()
    flips = _bits(base) ^ _bits(new)
    positions = np.flatnonzero(flips)
    if positions.size == 0:
        return "same", b""
    # gaps between positions rather than positions, in the narrowest type that holds them; the
    # changed elements as xor with the base, not as new values: a small change flips few bits
    gaps = np.diff(positions, prepend=0)
    gap_type = _gap_type(int(gaps.max()))
    if encoding == "sparse" and positions.size * (gap_type.itemsize + flips.itemsize) < flips.nbytes:
        return f"sparse:{gap_type.name}", _planes(gaps.astype(gap_type)) + _planes(flips[positions])
    return "xor", _planes(flips)


def decode_tensor(base: Tensor | None, kind: str, payload: bytes, dtype: torch.dtype, shape: list[int]) -> Tensor:
    """The new tensor from its base and payload; a fresh tensor, the base left untouched."""
    if kind == "same":
        return base
    bits_type = np.dtype(_BITS[torch.empty((), dtype=dtype).element_size()])
    if kind == "raw":
        return _from_bits(np.frombuffer(payload, dtype=bits_type).copy(), dtype, shape)
    bits = _bits(base).copy()
    if kind == "xor":
        bits ^= _unplanes(payload, bits_type)
    else:
        gap_type = np.dtype(kind.split(":", 1)[1])
        split = len(payload) // (gap_type.itemsize + bits_type.itemsize) * gap_type.itemsize
        positions = np.cumsum(_unplanes(payload[:split], gap_type), dtype=np.int64)
        bits[positions] ^= _unplanes(payload[split:], bits_type)
    return _from_bits(bits, dtype, shape)


@dataclass
class DeltaFile:
    version: int
    base_version: int
    step: int
    entries: list[dict]  # per tensor: name, dtype, shape, checksum, kind, offset, length (in body)
    body: bytes

    def payload(self, entry: dict) -> bytes:
        if not entry["length"]:
            return b""
        frame = self.body[entry["offset"]:entry["offset"] + entry["length"]]
        return zstandard.ZstdDecompressor().decompress(frame)


def write_delta(path: Path, version: int, base_version: int, step: int, base: Mapping[str, Tensor],
                new: Mapping[str, Tensor], sums: Mapping[str, str], encoding: str, level: int = 3) -> int:
    """Write the delta atomically (``sums``: each new tensor's checksum); returns its size in bytes."""
    compressor = zstandard.ZstdCompressor(level=level)
    entries, frames, offset = [], [], 0
    for name in sorted(new):
        kind, payload = encode_tensor(base.get(name), new[name], encoding)
        frame = compressor.compress(payload) if payload else b""
        entries.append({"name": name, "dtype": str(new[name].dtype).removeprefix("torch."),
                        "shape": list(new[name].shape), "checksum": sums[name], "kind": kind,
                        "offset": offset, "length": len(frame)})
        frames.append(frame)
        offset += len(frame)
    header = json.dumps({"version": version, "base_version": base_version, "step": step,
                         "encoding": encoding, "tensors": entries}).encode()

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            out.write(MAGIC + _LENGTH.pack(len(header)) + header)
            for frame in frames:
                out.write(frame)

    write_atomically(path, write)
    return path.stat().st_size


def read_delta(path: Path) -> DeltaFile:
    raw = path.read_bytes()
    if not raw.startswith(MAGIC):
        raise WeightVerificationError(f"{path} is not a milestream delta file")
    (length,) = _LENGTH.unpack_from(raw, len(MAGIC))
    start = len(MAGIC) + _LENGTH.size
    try:
        header = json.loads(raw[start:start + length])
    except ValueError as exc:
        raise WeightVerificationError(f"{path}: unreadable header: {exc}") from None
    return DeltaFile(header["version"], header["base_version"], header["step"], header["tensors"],
                     raw[start + length:])


def apply_delta(base: Mapping[str, Tensor], delta: DeltaFile) -> dict[str, Tensor]:
    """The tensors of ``delta.version``: unchanged ones shared with ``base``, changed ones new, every
    changed one checked against the checksum the trainer computed on its side."""
    out = {}
    for entry in delta.entries:
        name, kind = entry["name"], entry["kind"]
        if kind != "raw" and name not in base:
            raise WeightVerificationError(f"version {delta.version}: tensor {name} is missing from base "
                                          f"version {delta.base_version}")
        try:
            tensor = decode_tensor(base.get(name), kind, delta.payload(entry), getattr(torch, entry["dtype"]),
                                   entry["shape"])
        except (ValueError, RuntimeError, IndexError, AttributeError, zstandard.ZstdError) as exc:
            raise WeightVerificationError(f"version {delta.version}: tensor {name} cannot be decoded: {exc}") from None
        if kind != "same" and checksum(tensor) != entry["checksum"]:
            raise WeightVerificationError(f"version {delta.version}: tensor {name} does not match its checksum "
                                          f"after applying the delta to version {delta.base_version}")
        out[name] = tensor
    return out


# ---- the two halves --------------------------------------------------------------------------------

class DeltaSender:
    transport = "disk-delta"

    def __init__(self, cfg: Config):
        self.folder = weights_dir(cfg.run.run_dir)
        self.keep = cfg.trainer.keep_weight_versions
        self.full_every = cfg.weights.full_every
        self.encoding = cfg.weights.delta_encoding
        self.base: dict[str, Tensor] | None = None  # copies: the trainer's tensors change in place
        self.base_version = NO_BASE
        self.last_full = NO_BASE

    def publish(self, producer: RecordProducer, version: int, step: int,
                tensors: Mapping[str, Tensor]) -> WeightVersion:
        current = cpu_tensors(tensors, copy=True)
        names, sums = checksums(current)
        if self._full_due(version):
            path, _, _ = write_full(self.folder, version, step, current)
            record = announce(producer, version, step, self.transport, path, NO_BASE, names, sums, nbytes(current))
            self.last_full = version
        else:
            path = delta_path(self.folder, version)
            size = write_delta(path, version, self.base_version, step, self.base, current, dict(zip(names, sums)),
                               self.encoding)
            record = announce(producer, version, step, self.transport, path, self.base_version, names, sums, size)
        self.base, self.base_version = current, version
        self._prune(version)
        return record

    def _full_due(self, version: int) -> bool:
        # a sender started again (a resumed trainer) holds no base: its first version is full
        return (self.base is None or self.base_version != version - 1
                or version - self.last_full >= self.full_every)

    def _prune(self, version: int) -> None:
        """Keep the last ``keep`` versions and the chain that rebuilds the oldest of them."""
        keep_from = version - self.keep + 1
        fulls = [version_of(p) for p in self.folder.glob("v*.safetensors")]
        anchor = max((v for v in fulls if v <= keep_from), default=keep_from)
        prune(self.folder, keep_from=anchor)

    def close(self) -> None:
        self.base = None


class DeltaReceiver:
    every_version = False  # a skipped delta is rebuilt from the chain on disk

    def __init__(self, cfg: Config, engine_id: str):
        self.engine_id = engine_id
        self.held: dict[str, Tensor] | None = None  # the last version delivered: the next delta's base
        self.held_version = NO_BASE

    def receive(self, record: WeightVersion) -> dict[str, Tensor]:
        tensors = self._rebuild(Path(record.location).parent, record.version)
        verify(record, tensors)
        self.held, self.held_version = tensors, record.version
        return tensors

    def _rebuild(self, folder: Path, target: int) -> dict[str, Tensor]:
        """Walk back from ``target`` to a version held or stored full, then apply the deltas forward."""
        chain: list[DeltaFile] = []
        version = target
        while True:
            if self.held is not None and version == self.held_version:
                tensors = self.held
                break
            if full_path(folder, version).exists():
                tensors = read_verified_full(full_path(folder, version), version)
                break
            if not delta_path(folder, version).exists():
                raise WeightVerificationError(self._gap(folder, target, version))
            chain.append(read_delta(delta_path(folder, version)))
            version = chain[-1].base_version
        for delta in reversed(chain):
            tensors = apply_delta(tensors, delta)
        return tensors

    def _gap(self, folder: Path, target: int, missing: int) -> str:
        stored = sorted({version_of(p) for p in [*folder.glob("v*.safetensors"), *folder.glob("v*.delta")]})
        span = f"{stored[0]}..{stored[-1]}" if stored else "nothing"
        return (f"engine {self.engine_id} cannot rebuild version {target}: it holds version {self.held_version}, "
                f"and version {missing} is neither a delta nor a full version in {folder} (it holds {span}); "
                "the next full version (weights.full_every) will bring it back")

    def close(self) -> None:
        self.held = None
