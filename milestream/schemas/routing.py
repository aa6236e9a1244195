"""Routing replay (R3) on the wire: the top-k expert ids of every token and layer, packed small.

Miles keeps routing as int32 [tokens, layers, k]. Here an id takes the narrowest unsigned integer
that holds the expert count (1 byte up to 256 experts, else 2), and long trajectories are cut into
chunks of ``chunk_tokens`` tokens so no record nears the broker's message limit. The processor
joins a trajectory's chunks into its group sample unchanged.

Encoding ``zstd-sorted-delta`` (written now): a token's k ids are a set to the model (its output
sums the k experts' outputs, each with the gate weight of its own id), so they are sorted and kept
as the first id and the gaps to the next; the gaps are laid out slot-major [k, layers, tokens]
with the bytes of a 2-byte id split into separate planes, so that zstd sees long runs of values
with one distribution each. ``zstd`` (the first layout, still read): the ids as sampled,
[tokens, layers, k], zstd-compressed. benchmarks/r3_size.py measures both against int32.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import zstandard

from milestream.schemas.records import GroupSample, Routing

COMPRESSION = "zstd-sorted-delta"
PLAIN_COMPRESSION = "zstd"  # the first layout: ids as sampled, token-major


def id_width(num_experts: int) -> int:
    if not 0 < num_experts <= 65536:
        raise ValueError(f"num_experts must be in 1..65536, got {num_experts}")
    return 1 if num_experts <= 256 else 2


def _dtype(id_bytes: int) -> np.dtype:
    return np.dtype(np.uint8 if id_bytes == 1 else "<u2")


def pack(trajectory_id: str, group_id: str, sample_index: int, group_size: int, expert_ids: np.ndarray,
         num_experts: int, chunk_tokens: int = 8192, level: int = 3) -> list[Routing]:
    """Routing records for one trajectory; ``expert_ids`` is [tokens, layers, top_k]."""
    if expert_ids.ndim != 3:
        raise ValueError(f"expert ids must be [tokens, layers, top_k], got shape {expert_ids.shape}")
    if expert_ids.size and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    tokens, layers, top_k = expert_ids.shape
    width = id_width(num_experts)
    compressor = zstandard.ZstdCompressor(level=level)
    starts = range(0, max(tokens, 1), chunk_tokens)
    return [Routing(trajectory_id, group_id, sample_index, group_size, i, len(starts), tokens, layers, top_k,
                    width, COMPRESSION, compressor.compress(_planes(expert_ids[start:start + chunk_tokens], width)))
            for i, start in enumerate(starts)]


def _planes(expert_ids: np.ndarray, width: int) -> bytes:
    """Sorted ids as first id + gaps, slot-major, one byte plane per byte of the id width."""
    ids = np.sort(expert_ids, axis=2)
    gaps = np.diff(ids, axis=2, prepend=0).astype(_dtype(width))
    planes = np.ascontiguousarray(gaps.transpose(2, 1, 0)).view(np.uint8).reshape(*gaps.shape[::-1], width)
    return np.ascontiguousarray(np.moveaxis(planes, -1, 0)).tobytes()


def _from_planes(raw: bytes, tokens: int, layers: int, top_k: int, width: int) -> np.ndarray:
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, top_k, layers, tokens)
    gaps = np.ascontiguousarray(np.moveaxis(planes, 0, -1)).view(_dtype(width))[..., 0]
    return np.cumsum(gaps.transpose(2, 1, 0), axis=2, dtype=np.int64)


def unpack(layout: Sequence[int], compression: str, chunks: Sequence[bytes]) -> np.ndarray:
    """[tokens, layers, top_k] expert ids (int64) from the chunks of one trajectory, in order."""
    tokens, layers, top_k, width = layout
    if compression not in (COMPRESSION, PLAIN_COMPRESSION):
        raise ValueError(f"unknown routing compression {compression!r}")
    decompressor = zstandard.ZstdDecompressor()
    raws = [decompressor.decompress(chunk) for chunk in chunks]
    found = sum(len(raw) for raw in raws) // width
    if found != tokens * layers * top_k:
        raise ValueError(f"routing holds {found} ids, layout {list(layout)} needs {tokens * layers * top_k}")
    if compression == PLAIN_COMPRESSION:
        return np.frombuffer(b"".join(raws), dtype=_dtype(width)).reshape(tokens, layers, top_k).astype(np.int64)
    per_chunk = [len(raw) // (width * layers * top_k) for raw in raws]
    return np.concatenate([_from_planes(raw, n, layers, top_k, width) for raw, n in zip(raws, per_chunk)])


def expert_ids(sample: GroupSample) -> np.ndarray | None:
    """The routing of a joined sample, or None when its engine recorded none."""
    if not sample.routing_layout:
        return None
    return unpack(sample.routing_layout, sample.routing_compression, sample.routing_data)


def joined_fields(chunks: Sequence[Routing]) -> dict:
    """The GroupSample fields that carry these chunks (all of one trajectory, any order)."""
    if not chunks:
        return {}
    ordered = sorted(chunks, key=lambda c: c.chunk_index)
    first = ordered[0]
    return {"routing_layout": [first.num_tokens, first.num_layers, first.top_k, first.id_bytes],
            "routing_compression": first.compression, "routing_data": [c.data for c in ordered]}
