"""The P2P transfer plan: which slice of which tensor each sender rank writes to each receiver rank.

Both sides name tensors the Hugging Face way. A side with tensor parallel size > 1 holds each
parallel layer split the way Megatron-core and vLLM split it:

- column-parallel (q/k/v, gate/up, the vocabulary of embed_tokens and lm_head): output rows, dim 0;
- row-parallel (o_proj, down_proj): input columns, dim 1;
- everything else (norms, a row-parallel layer's bias) is replicated.

LoRA adapters follow their base layer the way vLLM shards them: a column-parallel layer's
``lora_B`` splits its rows and its ``lora_A`` is replicated; a row-parallel layer's ``lora_A``
splits its columns and its ``lora_B`` is replicated.

A ``Layout`` is ``replicas`` copies of the model, each split over ``tp_size`` ranks; global rank =
replica * tp_size + tp_rank. For every receiver rank the plan takes what it needs from the sender
ranks that hold it; where several sender ranks hold the same bytes (replicated tensors, data-parallel
sender replicas), receivers are spread over them round-robin so no one sender writes everything.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Layout:
    tp_size: int = 1
    replicas: int = 1

    @property
    def size(self) -> int:
        return self.tp_size * self.replicas

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size


@dataclass(frozen=True)
class Piece:
    """A slice to move: ``[start, stop)`` of the full tensor along ``dim`` (the whole tensor when
    ``dim`` is None), found at ``source_start`` of the sender's local tensor and written at
    ``target_start`` of the receiver's local tensor (along the same dim)."""

    name: str
    dim: int | None
    start: int
    stop: int
    source_start: int
    target_start: int


def split_dim(name: str) -> int | None:
    """The dim a tensor-parallel rank splits ``name`` along, or None when every rank holds all of it."""
    parts = name.split(".")
    module = next((p for p in reversed(parts) if p in _COLUMN_PARALLEL or p in _ROW_PARALLEL), None)
    if module is None:
        return None
    column = module in _COLUMN_PARALLEL
    if "lora_A" in parts:
        return None if column else 1
    if "lora_B" in parts:
        return 0 if column else None
    if parts[-1] == "bias":
        return 0 if column else None  # a row-parallel bias is added once, after the reduction
    return 0 if column else 1


def shard_range(length: int, tp_size: int, tp_rank: int, name: str = "") -> tuple[int, int]:
    if length % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} does not divide {name or 'a tensor'}'s {length} rows/columns")
    size = length // tp_size
    return tp_rank * size, (tp_rank + 1) * size


def transfer_plan(shapes: Mapping[str, Sequence[int]], sender: Layout,
                  receiver: Layout) -> dict[tuple[int, int], list[Piece]]:
    """{(sender rank, receiver rank): pieces in name order}; pairs with nothing to move are absent."""
    plan: dict[tuple[int, int], list[Piece]] = {}
    for name in sorted(shapes):
        for target in range(receiver.size):
            for source, piece in _pieces_for(name, tuple(shapes[name]), sender, receiver, target):
                plan.setdefault((source, target), []).append(piece)
    return plan


def _pieces_for(name: str, shape: tuple[int, ...], sender: Layout, receiver: Layout,
                target: int) -> list[tuple[int, Piece]]:
    dim = split_dim(name)
    receiver_split = dim is not None and receiver.tp_size > 1
    sender_split = dim is not None and sender.tp_size > 1
    need = shard_range(shape[dim], receiver.tp_size, receiver.tp_rank(target), name) if receiver_split else None
    if not sender_split:
        # every sender rank holds the whole tensor: one of them (round-robin by receiver) sends the slice
        source = target % sender.size
        if need is None:
            return [(source, Piece(name, None, 0, 0, 0, 0))]
        return [(source, Piece(name, dim, need[0], need[1], need[0], 0))]
    if need is None:
        need = (0, shape[dim])
    pieces = []
    for tp_rank in range(sender.tp_size):
        held = shard_range(shape[dim], sender.tp_size, tp_rank, name)
        start, stop = max(need[0], held[0]), min(need[1], held[1])
        if start < stop:
            source = (target % sender.replicas) * sender.tp_size + tp_rank
            pieces.append((source, Piece(name, dim, start, stop, start - held[0], start - need[0])))
    return pieces
