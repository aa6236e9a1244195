"""True on-policy numerics: the rollout engine and the trainer compute every token's log-prob with the
same operations in the same order, so both give the same float, bit for bit (rollout.true_on_policy).

Three things make a row's result depend on what else is computed with it, and each is removed here:

linear layers   MKL's sgemm gives a row another result when the call has few rows (M < 4 on one
                thread, up to M < 28 on sixteen, and never when M is a multiple of 4: its tail
                kernels sum in another order). ``RowBlockLinear`` pads the rows of every call to a
                multiple of ``ROW_BLOCK`` with zero rows, which it drops after.
attention       padding changes the length of softmax's and P.V's reductions, and a batched
                matmul of 2 or 3 rows an entry (a decode step's query heads per kv head) is not
                batch invariant. ``exact_attention`` gives each query the keys of its row from the
                row's first, ``KEY_BUCKET``-rounded (one shape serves many queries) and masked past
                its own last, and multiplies per row and kv head the row's queries, padded to
                ``ROW_BLOCK`` rows, against that window (batched; with rows a multiple of 16 an
                entry's result depends neither on the batch nor on its other rows): a decode step
                over a left-padded batch and a full forward over one unpadded sequence reduce the
                same numbers in the same order.
dtype path      the engine computes as the trainer does: fp32 weights and residual stream, bf16
                autocast where compute_dtype is bf16. ``cast_linear_weights`` gives the engine's
                linear layers the bf16 weights autocast would cast each forward, cast once: the
                engine holds what it held before, bf16 weights, but fp32 norms and embeddings.

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
            rows, cols = (buckets == bucket).nonzero(as_tuple=True)  # row-major: each row's queries together
            window = _attend(q[rows, cols], k, v, rows, starts, counts[rows, cols], bucket * KEY_BUCKET, scaling)
            out = out.index_put((rows, cols), window)
    return out, None


def _attend(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, starts: Tensor, counts: Tensor, length: int,
            scaling: float) -> Tensor:
    """N queries [N, H, D] of one window length: for each batch row and kv head, one matmul of the
    row's queries (those of its query heads, stacked, padded to ``ROW_BLOCK`` rows: MKL gives a row
    of a batched matmul the same result whatever the batch and the rows around it then) against
    the ``length`` keys from the row's first, each query masked past its own count."""
    n, heads, dim = q.shape
    kv_heads = k.shape[2]
    rep = heads // kv_heads  # query head h reads kv head h // rep
    owners, slot, per_owner = torch.unique_consecutive(rows, return_inverse=True, return_counts=True)
    local = torch.arange(n) - (per_owner.cumsum(0) - per_owner)[slot]
    width = int(per_owner.max())
    grid = q.new_zeros(len(owners), width, heads, dim).index_put((slot, local), q)
    stacked = width * rep
    extra = -(-stacked // ROW_BLOCK) * ROW_BLOCK - stacked
    queries = nn.functional.pad(_entries(grid, kv_heads), (0, 0, 0, extra))  # [R * Hkv, padded, D]
    offsets = torch.arange(length)
    positions = (starts[owners][:, None] + offsets).clamp(max=k.shape[1] - 1)  # clamped keys are masked
    keys = k[owners[:, None], positions].transpose(1, 2).reshape(-1, length, dim)  # [R * Hkv, L, D]
    values = v[owners[:, None], positions].transpose(1, 2).reshape(-1, length, dim)
    # an empty slot or padding row sees every key (of zero scores): a fully masked row would be nan
    seen = counts.new_full((len(owners), width, heads), length).index_put((slot, local), counts[:, None].expand(n, heads))
    seen = nn.functional.pad(_entries(seen[..., None], kv_heads)[..., 0], (0, extra), value=length)
    scores = torch.bmm(queries, keys.transpose(1, 2)) * scaling  # [R * Hkv, padded, L]
    probs = torch.softmax(scores.masked_fill(offsets >= seen[..., None], float("-inf")), dim=-1)
    mixed = torch.bmm(probs, values)[:, :stacked]  # [R * Hkv, width * rep, D]
    grid = mixed.reshape(len(owners), kv_heads, width, rep, dim).transpose(1, 2).reshape(len(owners), width, heads, dim)
    return grid[slot, local]


def _entries(grid: Tensor, kv_heads: int) -> Tensor:
    """[R, W, H, X] -> [R * Hkv, W * rep, X]: one entry per row and kv head, its query heads stacked."""
    rows, width, heads, last = grid.shape
    rep = heads // kv_heads
    return grid.reshape(rows, width, kv_heads, rep, last).transpose(1, 2).reshape(rows * kv_heads, width * rep, last)


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
        raise ValueError("exact attention needs each query's keys in one run from its row's first "
                         "(no sliding window or packing)")
    return first, counts


def _exact_mask(*args, **kwargs) -> Tensor | None:
    kwargs["allow_is_causal_skip"] = False  # a materialised mask, so padding is always visible
    return sdpa_mask(*args, **kwargs)


def _register() -> None:
    AttentionInterface.register(EXACT_ATTENTION, exact_attention)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)
