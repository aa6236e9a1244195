"""True on-policy numerics: the rollout engine and the trainer compute every token's log-prob with the
same operations in the same order, so both give the same float, bit for bit (rollout.true_on_policy).

Three things make a row's result depend on what else is computed with it, and each is removed here:

linear layers   MKL's sgemm gives a row another result when the call has few rows (M < 4 on one
                thread, up to M < 28 on sixteen, never when M is a multiple of 4: its tail kernels
                sum in another order). ``RowBlockLinear`` pads the rows of every call to a multiple
                of ``ROW_BLOCK`` with zero rows, which it drops after.
attention       padding changes the length of softmax's and P.V's reductions, and a batched
                matmul of 2 or 3 rows an entry (a decode step's query heads per kv head) is not
                batch invariant. ``exact_attention`` gives each query the keys of its row from the
                row's first, ``KEY_BUCKET``-rounded (one shape serves many queries) and masked past
                its own last, and multiplies per row and kv head the row's queries, padded to
                ``ROW_BLOCK`` rows, against that window (batched: an entry's result then depends
                neither on the batch nor on its other rows): a decode step over a left-padded
                batch and a full forward over one unpadded sequence reduce the same numbers in the
                same order.
dtype path      the engine computes as the trainer does: fp32 weights and residual stream, bf16
                autocast where compute_dtype is bf16. ``cast_linear_weights`` gives the engine's
                linear layers the bf16 weights autocast would cast each forward, cast once: the
                engine holds what it held before, bf16 weights, but fp32 norms and embeddings.

``scaled_logits`` is the last step both sides share: the logits in fp32 divided by the temperature,
before log_softmax. What stays outside: MoE routing (expert loops), other attention layouts (a sliding
window shorter than rollout.max_context_tokens, refused before any stage starts; packed sequences,
refused at the forward), and backends other than ``local``.
"""
from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

EXACT_ATTENTION = "milestream_exact"
# rows of a matmul: with a multiple of 4, MKL's sgemm and batched sgemm give a row the same result
# whatever the other rows and the batch (checked on its AVX512 and AVX2 paths, 1 to 16 threads)
ROW_BLOCK = 4
KEY_BUCKET = 32  # window lengths are multiples of this: fewer distinct shapes, at most 31 masked keys each


def scaled_logits(logits: Tensor, temperature: Tensor | float) -> Tensor:
    """``logits`` in fp32 over ``temperature`` (a float, or one per row [B, 1]); 0 counts as 1: a
    greedy engine records the untempered log-probs."""
    if isinstance(temperature, Tensor):
        return logits.float() / torch.where(temperature == 0, 1.0, temperature)
    return logits.float() / (temperature or 1.0)


class RowBlockLinear(nn.Linear):
    """nn.Linear whose rows are computed in blocks of ``ROW_BLOCK``: one row's output does not depend
    on how many rows the call has. ``cast_weight``: an engine's tied weight in the compute dtype."""

    cast_weight: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        if extra := _padding(rows):
            flat = torch.cat([flat, flat.new_zeros(extra, flat.shape[1])])
        weight = self.weight if self.cast_weight is None else self.cast_weight
        out = nn.functional.linear(flat, weight, self.bias)
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def refusal(config: PretrainedConfig, context: int | None = None) -> str | None:
    """Why exact attention cannot compute this model's forward, or None: it caps attention logits, or
    (``context``: the most tokens a sequence takes, rollout.max_context_tokens) it has sliding-window
    layers whose window is shorter (Gemma 2 and 3: a query attends over the last ``sliding_window``
    tokens only, and exact attention gives each query every key from its row's first)."""
    text = config.get_text_config(decoder=True)
    if getattr(text, "attn_logit_softcapping", None):
        return "caps its attention logits, which exact attention does not; set rollout.true_on_policy=false"
    window = getattr(text, "sliding_window", None)
    sliding = window is not None and "sliding_attention" in get_layer_types_and_kwargs(text)[0]
    if sliding and context is not None and window < context:
        return (f"has sliding-window layers that attend over the last {window} tokens only, fewer than "
                f"rollout.max_context_tokens ({context}), and exact attention has no window; set "
                f"rollout.max_context_tokens to at most {window}, or rollout.true_on_policy=false")
    return None


def make_exact(model: nn.Module, context: int | None = None) -> nn.Module:
    """``model`` (plain or peft-wrapped) in place: exact attention, every nn.Linear a RowBlockLinear
    (same parameters and names, so weight updates, checkpoints and exports do not change). Refuses what
    ``refusal`` names, for sequences of up to ``context`` tokens."""
    _register()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    refused = f"rollout.true_on_policy: {type(base).__name__}"
    if reason := refusal(base.config, context):
        raise ValueError(f"{refused} {reason}")
    base.set_attn_implementation(EXACT_ATTENTION)
    if base.config._attn_implementation != EXACT_ATTENTION:
        raise ValueError(f"{refused} does not take an attention implementation; set rollout.true_on_policy=false")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowBlockLinear
    return model


def cast_linear_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """The engine's linear layers in ``dtype``, as autocast casts them each forward (the same rounding),
    once: in place, but for a weight an embedding shares (a tied lm_head), which stays fp32 for the
    embedding's lookup and is cast into ``cast_weight``. fp32: nothing to cast."""
    if dtype == torch.float32:
        return
    tied = _tied(model)
    for module in model.modules():
        if isinstance(module, RowBlockLinear):
            if id(module.weight) in tied:
                module.cast_weight = module.weight.detach().to(dtype)
            else:
                module.to(dtype)


def recast_tied(model: nn.Module, dtype: torch.dtype, changed: Iterable[Tensor]) -> None:
    """After a weight update into ``changed``: the cast copies of those that are tied weights."""
    ids = {id(t) for t in changed} & _tied(model)
    for module in model.modules():
        if isinstance(module, RowBlockLinear) and id(module.weight) in ids:
            module.cast_weight = module.weight.detach().to(dtype)


def _tied(model: nn.Module) -> set[int]:
    return {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}


def autocast(dtype: torch.dtype) -> AbstractContextManager:
    """The trainer's compute context (backends/base.py compute_context) on the CPU: bf16 autocast
    over fp32 weights, or plain fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def exact_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    scaling: float, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """The transformers attention interface: query [B, H, Q, D], key and value [B, Hkv, K, D],
    ``attention_mask`` boolean [B, 1, Q, K]; returns [B, Q, H, D] in fp32."""
    if dropout or kwargs.get("s_aux") is not None:
        raise ValueError("exact attention has no dropout and no attention sinks")
    batch, heads, queries, dim = query.shape
    shape = (batch, queries, key.shape[2], heads, key.shape[1])
    windows = _plans.get(attention_mask, shape)
    with torch.autocast("cpu", enabled=False):
        out = query.new_zeros(batch, queries, heads, dim, dtype=torch.float32)
        for window in windows:
            out = out.index_put((window.rows, window.cols), _attend(window, query, key, value, scaling))
    return out, None


@dataclass(frozen=True)
class _Window:
    """The queries of one window length, laid out for the matmuls; the same for every layer of a forward."""

    rows: Tensor  # [N] each query's batch row
    cols: Tensor  # [N] and its index among the queries
    owners: Tensor  # [R] the batch rows with a query here
    slot: Tensor  # [N] each query's owner, as an index into owners
    local: Tensor  # [N] its place among its owner's queries
    width: int  # the most queries one owner has here
    keys: Tensor  # [R * Hkv * L] each owner's keys per kv head, from its first (clamped past the end:
    # those are masked), as rows of the cache flattened to [B * Hkv * K, D]
    masked: Tensor  # [R * Hkv, rows padded, L] True where a query row may not look


class _PlanCache:
    """The last forward's windows: every layer of a forward gets the same mask object (held here, so
    ``is`` cannot match a new mask at a recycled address)."""

    def __init__(self) -> None:
        self._last: tuple[Tensor | None, tuple, list[_Window]] | None = None

    def get(self, mask: Tensor | None, shape: tuple) -> list[_Window]:
        last = self._last  # one read: another thread (an engine next to a trainer) may replace it
        if last is not None and last[0] is mask and last[1] == shape:
            return last[2]
        windows = _plan(mask, *shape)
        self._last = (mask, shape, windows)
        return windows


_plans = _PlanCache()


def _plan(mask: Tensor | None, batch: int, queries: int, keys: int, heads: int, kv_heads: int) -> list[_Window]:
    starts, counts = _key_ranges(mask, batch, queries, keys)
    buckets = (counts + KEY_BUCKET - 1) // KEY_BUCKET
    rep = heads // kv_heads
    windows = []
    for bucket in buckets.unique().tolist():
        if bucket == 0:  # a padding query: no key to attend, its output is never read
            continue
        length = bucket * KEY_BUCKET
        rows, cols = (buckets == bucket).nonzero(as_tuple=True)  # row-major: each row's queries together
        owners, slot, per_owner = torch.unique_consecutive(rows, return_inverse=True, return_counts=True)
        local = torch.arange(len(rows)) - (per_owner.cumsum(0) - per_owner)[slot]
        width = int(per_owner.max())
        offsets = torch.arange(length)
        positions = (starts[owners][:, None] + offsets).clamp(max=keys - 1)
        # an empty slot or padding row sees every key (of zero scores): a fully masked row would be nan
        seen = counts.new_full((len(owners), width), length).index_put((slot, local), counts[rows, cols])
        seen = seen[:, None, :, None].expand(-1, kv_heads, -1, rep).reshape(len(owners) * kv_heads, width * rep)
        seen = nn.functional.pad(seen, (0, _padding(width * rep)), value=length)
        keys_at = (owners[:, None, None] * kv_heads + torch.arange(kv_heads)[None, :, None]) * keys + positions[:, None, :]
        windows.append(_Window(rows, cols, owners, slot, local, width, keys_at.reshape(-1), offsets >= seen[..., None]))
    return windows


def _attend(window: _Window, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """The window's N queries [N, H, D]: for each owner and kv head one matmul of the owner's queries
    (those of its query heads, stacked, padded to ``ROW_BLOCK`` rows: MKL gives a row of a batched
    matmul the same result whatever the batch and the rows around it then) against its keys, each
    query masked past its own count."""
    owners, width = len(window.owners), window.width
    heads, dim, kv_heads = query.shape[1], query.shape[3], key.shape[1]
    rep = heads // kv_heads  # query head h reads kv head h // rep
    q = query[window.rows, :, window.cols].float()  # [N, H, D]
    grid = q.new_zeros(owners, width, heads, dim).index_put((window.slot, window.local), q)
    stacked = grid.reshape(owners, width, kv_heads, rep, dim).transpose(1, 2).reshape(-1, width * rep, dim)
    stacked = nn.functional.pad(stacked, (0, 0, 0, _padding(width * rep)))  # [R * Hkv, padded, D]
    keys = key.reshape(-1, dim).index_select(0, window.keys).float().reshape(owners * kv_heads, -1, dim)
    values = value.reshape(-1, dim).index_select(0, window.keys).float().reshape(owners * kv_heads, -1, dim)
    scores = torch.bmm(stacked, keys.transpose(1, 2)) * scaling
    probs = torch.softmax(scores.masked_fill(window.masked, float("-inf")), dim=-1)
    mixed = torch.bmm(probs, values)[:, :width * rep]
    grid = mixed.reshape(owners, kv_heads, width, rep, dim).transpose(1, 2).reshape(owners, width, heads, dim)
    return grid[window.slot, window.local]


def _padding(rows: int) -> int:
    return -(-rows // ROW_BLOCK) * ROW_BLOCK - rows


def _key_ranges(mask: Tensor | None, batch: int, queries: int, keys: int) -> tuple[Tensor, Tensor]:
    """Each row's first key [B] and each query's number of keys [B, Q]; refuses a mask whose keys for
    one query are not one run from the row's first key."""
    if mask is None:  # causal, unpadded: query j sees keys 0 .. keys - queries + j
        counts = (torch.arange(queries) + keys - queries + 1).expand(batch, queries)
        return torch.zeros(batch, dtype=torch.long), counts
    if mask.dtype != torch.bool:
        raise ValueError(f"exact attention needs a boolean mask, got {mask.dtype}")
    seen = mask[:, 0].expand(batch, queries, keys).to(torch.uint8)
    counts = seen.sum(-1)
    starts = seen.argmax(-1)
    ends = keys - seen.flip(-1).argmax(-1)
    first = torch.where(counts > 0, starts, keys).amin(-1)
    if bool((((ends - starts != counts) | (starts != first[:, None])) & (counts > 0)).any()):
        raise ValueError("rollout.true_on_policy: exact attention needs each query's keys in one run from "
                         "its row's first (no sliding window shorter than the sequence, no packing); "
                         "set rollout.true_on_policy=false")
    return first, counts


def _exact_mask(*args, **kwargs) -> Tensor | None:
    kwargs["allow_is_causal_skip"] = False  # a materialised mask, so padding is always visible
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)
