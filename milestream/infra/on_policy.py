"""True on-policy numerics: the rollout engine and the trainer compute every token's log-prob with the
same operations in the same order, so both give the same float, bit for bit (rollout.true_on_policy).

Three things make a row's result depend on what else is computed with it, and each is removed here:

linear layers   MKL's sgemm gives a row a different result when the matrix has a few rows (M < 4
                on one thread, up to M < 28 on sixteen: its tail kernels sum in another order);
                M a multiple of 4 always gets the panel kernel. ``RowBlockLinear`` pads the rows of
                every call to a multiple of ``ROW_BLOCK`` with zero rows, which it drops after.
attention       padding and batch change the length of softmax's and P.V's reductions, and MKL's
                batched matmul is not batch invariant either (an entry's result depends on the
                batch). ``exact_attention`` gives every query a window of its own keys, from its
                first real key, ``KEY_BUCKET``-rounded (so one shape serves many queries), masked
                past its last, and reduces with ATen's elementwise product, sum and softmax, whose
                result for one row depends only on that row: a decode step over a left-padded batch
                and a full forward over one unpadded sequence then reduce the same numbers in the
                same order.
dtype path      the engine computes as the trainer does: fp32 weights and residual stream, bf16
                autocast where compute_dtype is bf16. ``cast_linear_weights`` gives the engine the
                bf16 weights autocast would cast each forward (the same rounding), cast once.

``scaled_logits`` is the last step both sides share: the logits in fp32 divided by the temperature,
before log_softmax. What stays outside: MoE routing (expert loops), other attention layouts
(sliding windows, packed sequences: refused), and backends other than ``local``.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT_ATTENTION = "milestream_exact"
ROW_BLOCK = 16  # a multiple of every sgemm row panel seen (4); the cost is at most 15 zero rows a call
KEY_BUCKET = 32  # window lengths are multiples of this: fewer distinct shapes, at most 31 masked keys each


def scaled_logits(logits: Tensor, temperature: Tensor | float) -> Tensor:
    """``logits`` in fp32 over ``temperature`` (a float, or one per row [B, 1]); 0 counts as 1: a
    greedy engine records the untempered log-probs."""
    if isinstance(temperature, Tensor):
        return logits.float() / torch.where(temperature == 0, 1.0, temperature)
    return logits.float() / (temperature or 1.0)


class RowBlockLinear(nn.Linear):
    """nn.Linear whose rows are computed in blocks of ``ROW_BLOCK``: one row's output does not depend
    on how many rows the call has. ``cast_weight``: the engine's weight in the compute dtype."""

    cast_weight: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        padded = -(-rows // ROW_BLOCK) * ROW_BLOCK
        if padded != rows:
            flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
        weight = self.weight if self.cast_weight is None else self.cast_weight
        out = nn.functional.linear(flat, weight, self.bias)
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def make_exact(model: nn.Module) -> nn.Module:
    """``model`` (plain or peft-wrapped) in place: exact attention, every nn.Linear a RowBlockLinear
    (same parameters and names, so weight updates, checkpoints and exports do not change)."""
    _register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(EXACT_ATTENTION)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowBlockLinear
    return model


def cast_linear_weights(model: nn.Module, dtype: torch.dtype, changed: Iterable[Tensor] | None = None) -> None:
    """Caches each RowBlockLinear's weight in ``dtype`` (all of them, or those whose weight is one of
    ``changed``); fp32 keeps none: the weights are used as they are."""
    ids = None if changed is None else {id(t) for t in changed}
    for module in model.modules():
        if isinstance(module, RowBlockLinear) and (ids is None or id(module.weight) in ids):
            module.cast_weight = None if dtype == torch.float32 else module.weight.detach().to(dtype)


def autocast(dtype: torch.dtype) -> AbstractContextManager:
    """The trainer's compute context (backends/base.py compute_context) on the CPU: bf16 autocast
    over fp32 weights, or plain fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def exact_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """The transformers attention interface: query [B, H, Q, D], key and value [B, Hkv, K, D],
    ``attention_mask`` boolean [B, 1, Q, K]; returns [B, Q, H, D] in fp32."""
    if dropout:
        raise ValueError("exact attention has no dropout")
    batch, heads, queries, dim = query.shape
    starts, counts = _key_ranges(attention_mask, batch, queries, key.shape[2])
    buckets = (counts + KEY_BUCKET - 1) // KEY_BUCKET
    with torch.autocast("cpu", enabled=False):
        q = query.float().transpose(1, 2)  # [B, Q, H, D]
        k, v = key.float().transpose(1, 2), value.float().transpose(1, 2)  # [B, K, Hkv, D]
        out = q.new_zeros(batch, queries, heads, dim)
        for bucket in buckets.unique().tolist():
            if bucket == 0:  # a padding query: no key to attend, its output is never read
                continue
            rows, cols = (buckets == bucket).nonzero(as_tuple=True)
            window = _attend(q[rows, cols], k, v, rows, starts[rows, cols], counts[rows, cols],
                             bucket * KEY_BUCKET, scaling)
            out = out.index_put((rows, cols), window)
    return out, None


def _attend(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, starts: Tensor, counts: Tensor, length: int,
            scaling: float) -> Tensor:
    """N queries [N, H, D], each over ``length`` keys of its row from its first one (those past its
    count masked); every tensor made contiguous in one layout, whatever N and the caller's layout."""
    n, heads, dim = q.shape
    kv_heads = k.shape[2]
    offsets = torch.arange(length)
    positions = (starts[:, None] + offsets).clamp(max=k.shape[1] - 1)  # clamped keys are masked below
    keys = k[rows[:, None], positions].permute(0, 2, 1, 3).contiguous().unsqueeze(2)  # [N, Hkv, 1, L, D]
    values = v[rows[:, None], positions].permute(0, 2, 1, 3).contiguous().unsqueeze(2)
    grouped = q.reshape(n, kv_heads, heads // kv_heads, 1, dim)  # query head h reads kv head h // rep
    scores = (grouped * keys).sum(-1) * scaling  # [N, Hkv, rep, L]
    scores = scores.masked_fill((offsets >= counts[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs.unsqueeze(-1) * values).sum(-2).reshape(n, heads, dim)


def _key_ranges(mask: Tensor | None, batch: int, queries: int, keys: int) -> tuple[Tensor, Tensor]:
    """Each query's first key and number of keys [B, Q]; refuses a mask whose keys are not one run."""
    if mask is None:  # causal, unpadded: query j sees keys 0 .. keys - queries + j
        counts = (torch.arange(queries) + keys - queries + 1).expand(batch, queries)
        return torch.zeros_like(counts), counts
    if mask.dtype != torch.bool:
        raise ValueError(f"exact attention needs a boolean mask, got {mask.dtype}")
    seen = mask[:, 0].expand(batch, queries, keys).to(torch.uint8)
    counts = seen.sum(-1)
    starts = seen.argmax(-1)
    ends = keys - seen.flip(-1).argmax(-1)
    if bool(((ends - starts != counts) & (counts > 0)).any()):
        raise ValueError("exact attention needs each query's keys in one run (no sliding window or packing)")
    return starts, counts


def _exact_mask(*args, **kwargs) -> Tensor | None:
    kwargs["allow_is_causal_skip"] = False  # a materialised mask, so padding is always visible
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)
