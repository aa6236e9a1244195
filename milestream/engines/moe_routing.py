"""Recording MoE routing (R3) in the CPU engine: the top-k expert ids of every token and layer.

Which tokens: exactly those the trainer's forward runs through the model, i.e. the prompt and
every response token except the last (the last is sampled from the model's output and never fed
back in). So a trajectory of P prompt and T response tokens carries P + T - 1 routing rows, row i
the experts that position i went through.

How: a forward hook on each layer's top-k router keeps the ids of the latest forward pass; after
each prefill or decode step the engine hands them out per row, cutting off the left padding of
its batch. A row retracted by a weight update is prefilled again (prompt + its tokens) on the new
weights, and that prefill's routing replaces what the row had: the new KV cache is what the rest
of the row attends to, and the trainer's forward runs once over the whole sequence too. A row
kept in place across an update keeps the routing its tokens had when they were computed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from torch import Tensor, nn

from milestream.schemas.records import Routing
from milestream.schemas.routing import pack


@dataclass(frozen=True)
class RecordedRouting:
    expert_ids: np.ndarray  # [prompt + response - 1 tokens, layers, top_k], the model's own top-k order
    num_experts: int


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE layer, in layer order (transformers' *TopKRouter modules:
    forward(hidden) -> (router logits, gate weights, expert ids))."""
    return [module for module in model.modules()
            if type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")]


@dataclass
class RowRouting:
    """The routing one engine row has gathered so far, as arrays of [tokens, layers, top_k]."""

    num_experts: int
    parts: list[np.ndarray] = field(default_factory=list)

    def result(self) -> RecordedRouting:
        return RecordedRouting(np.concatenate(self.parts), self.num_experts)


class RoutedRow(Protocol):
    routing: RowRouting | None

    def context(self) -> tuple[int, ...]: ...


class RoutingTap:
    """Forward hooks on a model's routers; ``attach`` gives None for a dense model."""

    def __init__(self, model_routers: Sequence[nn.Module]) -> None:
        self.num_experts = int(model_routers[0].num_experts)
        self._latest: list[Tensor | None] = [None] * len(model_routers)
        for layer, router in enumerate(model_routers):
            router.register_forward_hook(self._hook(layer))

    @classmethod
    def attach(cls, model: nn.Module) -> RoutingTap | None:
        found = routers(model)
        return cls(found) if found else None

    def _hook(self, layer: int):
        def keep_ids(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
            self._latest[layer] = output[2].detach()
        return keep_ids

    def _take(self, rows: int, width: int) -> np.ndarray:
        """The latest forward's ids as [rows, width, layers, top_k]."""
        if any(ids is None for ids in self._latest):
            raise RuntimeError("a router did not run in the last forward pass")
        ids = np.stack([t.numpy() for t in self._latest], axis=1)  # [rows * width, layers, top_k]
        self._latest = [None] * len(self._latest)
        return ids.reshape(rows, width, *ids.shape[1:])

    def after_prefill(self, rows: Sequence[RoutedRow], prompt_of_row: Sequence[int], prompts: int, width: int) -> None:
        """Each row's context routing from a left-padded prefill of ``prompts`` distinct contexts."""
        ids = self._take(prompts, width)
        for row, prompt in zip(rows, prompt_of_row):
            length = len(row.context())
            row.routing = RowRouting(self.num_experts, [ids[prompt, width - length:]])

    def after_decode(self, rows: Sequence[RoutedRow]) -> None:
        """The routing of the one token each row fed in this decode step."""
        ids = self._take(len(rows), 1)
        for row, step in zip(rows, ids):
            row.routing.parts.append(step)


def routing_records(trajectory_id: str, group_id: str, sample_index: int, group_size: int,
                    routing: RecordedRouting | None) -> list[Routing]:
    """The ``rollout.routing`` chunks of one trajectory; none for a dense model."""
    if routing is None:
        return []
    return pack(trajectory_id, group_id, sample_index, group_size, routing.expert_ids, routing.num_experts)
