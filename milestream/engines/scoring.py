"""Scoring given tokens: the log-prob of each response token after its prompt and the response tokens before
it, in one forward, nothing sampled (a teacher's forward in on-policy distillation: producers/teacher.py).

``CpuEngine.score`` runs ``score_batch`` between its steps in its own numerics, so under
rollout.true_on_policy a score equals, bit for bit, the log-prob the trainer computes for that token and the
one an engine of the same weights recorded when it sampled it. ``HttpEngine.score`` asks an engine behind
SGLang's HTTP API for the same (prompt log-probs of a request that generates nothing).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import DynamicCache

from milestream.infra import on_policy


@dataclass(frozen=True)
class ScoreRequest:
    prompt_ids: tuple[int, ...]  # at least one token
    response_ids: tuple[int, ...]
    temperature: float  # as a sampler's: log_softmax(logits / temperature), 0 counting as 1


class Scorer(Protocol):
    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """Each request's log-probs, one per response token, in order."""


def left_padded(contexts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
    """[N, longest] token ids right-aligned, and their mask (1 on the real tokens)."""
    width = max(len(c) for c in contexts)
    ids = torch.zeros(len(contexts), width, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, context in enumerate(contexts):
        ids[i, width - len(context):] = torch.tensor(context, dtype=torch.long)
        mask[i, width - len(context):] = 1
    return ids, mask


def full_kv_cache() -> DynamicCache:
    """A KV cache that keeps every key of every layer, the mask alone applying a sliding window (as in a
    forward without cache). One built from the model's config keeps only the last ``sliding_window - 1``
    keys of a sliding-window layer (Gemma 2 and 3, Mistral): that length stops matching a mask over the
    whole left-padded context once a row passes the window, and the engine's edits (rows merged, leading
    padding dropped) would cut keys the layer no longer holds."""
    return DynamicCache()


def score_batch(forward: Callable[..., Any], requests: Sequence[ScoreRequest]) -> list[list[float]]:
    """The log-probs of ``requests`` under ``forward`` (a model call): each distinct prompt runs once
    (left-padded), its KV cache copied to every response that follows it; then all responses at once,
    right-padded, each after its prompt."""
    out: list[list[float]] = [[] for _ in requests]
    rows = [i for i, r in enumerate(requests) if r.response_ids]  # an empty response has nothing to score
    if not rows:
        return out
    prompts: dict[tuple[int, ...], int] = {}
    for i in rows:
        prompts.setdefault(tuple(requests[i].prompt_ids), len(prompts))
    ids, mask = left_padded(list(prompts))
    cache = full_kv_cache()
    first = forward(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    index = torch.tensor([prompts[tuple(requests[i].prompt_ids)] for i in rows])
    cache.batch_select_indices(index)
    responses = [requests[i].response_ids for i in rows]
    width = max(len(r) for r in responses)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    tail = torch.zeros(len(rows), width, dtype=torch.long)
    for row, response in enumerate(responses):
        tokens[row, :len(response)] = torch.tensor(response, dtype=torch.long)
        tail[row, :len(response)] = 1
    logits = first[index][:, None]  # predicts each response's first token
    if width > 1:
        start = mask.sum(-1)[index][:, None]
        rest = forward(input_ids=tokens[:, :-1], attention_mask=torch.cat([mask[index], tail[:, :-1]], dim=1),
                       position_ids=start + torch.arange(width - 1), past_key_values=cache, use_cache=True).logits
        logits = torch.cat([logits, rest], dim=1)
    temperatures = torch.tensor([requests[i].temperature for i in rows], dtype=torch.float32)[:, None, None]
    logp = torch.log_softmax(on_policy.scaled_logits(logits, temperatures), dim=-1)  # as the sampler computes it
    picked = logp.gather(-1, tokens[..., None])[..., 0]
    for row, i in enumerate(rows):
        out[i] = picked[row, :len(responses[row])].tolist()
    return out
