"""Bucketed preparation shared by the broadcast and P2P transports.

A version's tensors (Hugging Face names, already gathered into full tensors by the trainer backend,
or the shards a P2P target needs) are laid out back to back in flat byte buckets of about
``bucket_mb`` MiB. The ``Manifest`` says where each tensor lives (bucket, offset) with its dtype,
shape and xxh64 checksum; it travels before the bytes, so a receiver allocates each bucket once,
receives straight into it and rebuilds every tensor as a view of it (no copy).

The sender packs one bucket at a time into a staging buffer it reuses, so preparation costs one
bucket of memory, not a second copy of the model.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from milestream.streams.weights.base import WeightVerificationError, checksum

# Every entry starts on a 256-byte boundary: a uint8 slice can then be viewed as any dtype, and CUDA
# kernels see the alignment they expect from their own allocator.
ALIGN = 256
MIB = 1024 * 1024


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes from the start of the bucket
    nbytes: int
    checksum: str  # xxh64 of the tensor's bytes, as base.checksum computes it


@dataclass(frozen=True)
class Manifest:
    version: int
    bucket_sizes: tuple[int, ...]  # bytes of each bucket, entries and alignment padding included
    entries: tuple[Entry, ...]

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def in_bucket(self, index: int) -> list[Entry]:
        return [e for e in self.entries if e.bucket == index]

    def to_bytes(self) -> bytes:
        return json.dumps({"version": self.version, "bucket_sizes": list(self.bucket_sizes),
                           "entries": [[e.name, e.dtype, list(e.shape), e.bucket, e.offset, e.nbytes, e.checksum]
                                       for e in self.entries]}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Manifest":
        data = json.loads(raw)
        entries = tuple(Entry(name, dtype, tuple(shape), bucket, offset, nbytes, digest)
                        for name, dtype, shape, bucket, offset, nbytes, digest in data["entries"])
        return cls(data["version"], tuple(data["bucket_sizes"]), entries)


def plan_buckets(tensors: Mapping[str, Tensor], version: int, bucket_mb: int = 512,
                 known_checksums: Mapping[str, str] | None = None) -> Manifest:
    """Where each tensor goes, in name order, and its checksum (from ``known_checksums`` when the
    caller already has it); nothing is copied yet.

    Tensors fill a bucket until the next one would overflow it; a tensor larger than a bucket gets a
    bucket of its own (splitting it would cost the receiver a copy to glue it back).
    """
    limit = bucket_mb * MIB
    entries: list[Entry] = []
    sizes: list[int] = []
    for name in sorted(tensors):
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        offset = _aligned(sizes[-1]) if sizes else 0
        if not sizes or (sizes[-1] > 0 and offset + nbytes > limit):
            sizes.append(0)
            offset = 0
        digest = known_checksums[name] if known_checksums and name in known_checksums else checksum(tensor)
        entries.append(Entry(name, _dtype_name(tensor.dtype), tuple(tensor.shape), len(sizes) - 1, offset, nbytes,
                             digest))
        sizes[-1] = offset + nbytes
    return Manifest(version, tuple(sizes), tuple(entries))


def pack_bucket(tensors: Mapping[str, Tensor], manifest: Manifest, index: int,
                staging: Tensor | None = None) -> Tensor:
    """Bucket ``index`` as one flat uint8 tensor, written into ``staging`` when it is large enough.

    ``tensors`` may be strided views (a P2P shard cut along columns): the copy into the bucket is
    the one copy a transfer needs anyway.
    """
    size = manifest.bucket_sizes[index]
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    if staging is None or staging.numel() < size:
        staging = torch.empty(size, dtype=torch.uint8, device=device)
    bucket = staging[:size]
    for entry in manifest.in_bucket(index):
        _view(bucket, entry).copy_(tensors[entry.name])
    return bucket


def unpack_bucket(manifest: Manifest, index: int, bucket: Tensor) -> dict[str, Tensor]:
    """The tensors of bucket ``index``, as views of ``bucket`` (which must stay alive with them)."""
    if bucket.numel() < manifest.bucket_sizes[index]:
        raise WeightVerificationError(f"version {manifest.version}: bucket {index} holds {bucket.numel()} bytes, "
                                      f"its manifest needs {manifest.bucket_sizes[index]}")
    return {entry.name: _view(bucket, entry) for entry in manifest.in_bucket(index)}


def empty_buckets(manifest: Manifest, device: torch.device | str = "cpu") -> list[Tensor]:
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in manifest.bucket_sizes]


def verify_entries(manifest: Manifest, tensors: Mapping[str, Tensor]) -> None:
    """Raise WeightVerificationError unless every manifest entry arrived with its checksum."""
    missing = sorted(e.name for e in manifest.entries if e.name not in tensors)
    differing = sorted(e.name for e in manifest.entries if e.name in tensors and checksum(tensors[e.name]) != e.checksum)
    if missing or differing:
        raise WeightVerificationError(f"version {manifest.version}: {len(missing)} tensors missing {missing[:3]}, "
                                      f"checksum mismatch on {len(differing)} e.g. {differing[:3]}")


def _view(bucket: Tensor, entry: Entry) -> Tensor:
    raw = bucket[entry.offset:entry.offset + entry.nbytes]
    return raw.view(getattr(torch, entry.dtype)).view(entry.shape)


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
