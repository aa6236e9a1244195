"""Routing replay (R3): the trainer's forward routes every token to the experts the rollout used.

Without it the trainer's MoE layers pick their own top-k, and wherever its numerics (another batch
shape, another dtype, weights one step newer) tip a near-tie the other way, a token goes through
other experts than the ones that sampled it, and the importance ratio compares two different
sub-networks. Replay keeps the rollout's expert *choice* and nothing else, as Miles/slime's
``compute_topk`` patch does: the gate weights come from the trainer's own router logits
(softmax over all experts), gathered at the replayed experts and renormalized when the model
normalizes its top-k (``norm_topk_prob``), so the router still gets its gradient. Positions
without a recorded choice (the right padding of shorter responses) keep the model's own top-k.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn

from milestream.config import TrainerConfig
from milestream.train.logprobs import Forward, shared_prompt_forward
from milestream.engines.moe_routing import routers
from milestream.schemas.records import GroupSample
from milestream.schemas.routing import expert_ids

NO_CHOICE = -1  # a position the rollout did not route: the model's own top-k stays


def recorded_routing(cfg: TrainerConfig, samples: Sequence[GroupSample]) -> list[np.ndarray] | None:
    """Each sample's [prompt + response - 1, layers, top_k] expert ids when the trainer replays
    them; None when replay is off or no sample carries routing (a dense model)."""
    if not cfg.routing_replay:
        return None
    routing = [expert_ids(sample) for sample in samples]
    if all(ids is None for ids in routing):
        return None
    if cfg.backend != "local":
        raise ValueError(f"trainer.routing_replay runs on trainer.backend=local, not {cfg.backend} "
                         "(or set trainer.routing_replay=false)")
    for sample, ids in zip(samples, routing):
        expected = len(sample.prompt_ids) + len(sample.response_ids) - 1
        if ids is None or ids.shape[0] != expected:
            found = "none" if ids is None else f"{ids.shape[0]} tokens"
            raise ValueError(f"trajectory {sample.trajectory_id}: field routing_layout holds {found}, its "
                             f"prompt + response - 1 is {expected} tokens")
    return routing


@contextmanager
def replaying(model: nn.Module, calls: Sequence[np.ndarray]) -> Iterator[None]:
    """Inside, the i-th forward of ``model`` routes as ``calls[i]`` says: [layers, tokens of that
    forward (batch-major), top_k], NO_CHOICE where the model's own top-k should stay."""
    layers = routers(model)
    if not layers:
        raise ValueError("routing replay needs an MoE model; this one has no top-k routers")
    queues = [deque(torch.from_numpy(np.ascontiguousarray(call[layer])) for call in calls)
              for layer in range(len(layers))]
    for call in calls:
        if call.shape[0] != len(layers) or call.shape[2] != layers[0].top_k:
            raise ValueError(f"routing of {call.shape[0]} layers x top-{call.shape[2]} does not fit the model's "
                             f"{len(layers)} layers x top-{layers[0].top_k}")
    handles = [router.register_forward_hook(_replay_hook(queue)) for router, queue in zip(layers, queues)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay_hook(queue: deque[Tensor]):
    def replay(router: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        logits, _, own = output
        recorded = queue.popleft().to(own.device)
        if recorded.shape != own.shape:
            raise ValueError(f"replayed routing covers {recorded.shape[0]} tokens, the forward runs {own.shape[0]}")
        chosen = torch.where(recorded == NO_CHOICE, own, recorded)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
        if getattr(router, "norm_topk_prob", True):  # Mixtral's router always normalizes
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen
    return replay


def replayed_forward(model: nn.Module, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                     routing: Sequence[np.ndarray], temperature: float = 1.0,
                     hidden: bool = False, entropy: bool = False) -> Forward:
    """``shared_prompt_forward`` routed as recorded. Samples whose prompts were routed alike share
    one prompt pass; one whose prompt was routed otherwise (prefilled in another batch, or again
    after a weight update) gets its own, so every sample replays exactly what it recorded."""
    prompt_len = len(prompt_ids)
    subsets: dict[bytes, list[int]] = {}
    for index, ids in enumerate(routing):
        subsets.setdefault(ids[:prompt_len].tobytes(), []).append(index)
    longest = max(len(r) for r in responses)
    order, parts = [], []
    for rows in subsets.values():
        with replaying(model, _calls(prompt_len, [routing[i] for i in rows], [len(responses[i]) for i in rows])):
            part = shared_prompt_forward(model, prompt_ids, [responses[i] for i in rows], temperature, hidden, entropy)
        order += rows
        parts.append(part)
    inverse = torch.tensor(np.argsort(order))

    def joined(tensors: list[Tensor | None]) -> Tensor | None:
        """The subsets' rows, right-padded to the longest response, back in the samples' order."""
        if tensors[0] is None:
            return None
        padding = [(0, 0) * (t.dim() - 2) + (0, longest - t.shape[1]) for t in tensors]
        return torch.cat([nn.functional.pad(t, pad) for t, pad in zip(tensors, padding)])[inverse]

    return Forward(*(joined([getattr(part, field) for part in parts]) for field in Forward._fields))


def _calls(prompt_len: int, routing: Sequence[np.ndarray], lengths: Sequence[int]) -> list[np.ndarray]:
    """What ``shared_prompt_forward``'s passes route: the prompt once, then every response but its
    last token, right-padded to the longest; each [layers, tokens, top_k]."""
    prompt = routing[0][:prompt_len].transpose(1, 0, 2)
    width = max(lengths) - 1
    if width == 0:
        return [prompt]
    layers, top_k = prompt.shape[0], prompt.shape[2]
    rest = np.full((len(routing), width, layers, top_k), NO_CHOICE, dtype=np.int64)
    for row, (ids, length) in enumerate(zip(routing, lengths)):
        rest[row, :length - 1] = ids[prompt_len:]
    return [prompt, rest.transpose(2, 0, 1, 3).reshape(layers, -1, top_k)]
