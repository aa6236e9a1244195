"""Bytes of one long trajectory's routing record (R3): Miles' int32 layout against milestream's.

One JSON line: ``int32_bytes`` (Miles: int32 [tokens, layers, k]), ``milestream_bytes`` (what
schemas/routing.py puts on rollout.routing, all chunks), their ``ratio``, the same for the first
wire layout (ids as sampled, narrow ints, zstd) and for uniform-random experts (the worst case), and
how the expert choices were drawn with the statistics they came out with.

No MoE router statistics are available offline, so the choices are drawn from a generative model
with the three effects published MoE analyses report, each a knob below:
  - skewed popularity per layer: a log-normal weight per expert (sigma 0.5: the busiest expert of a
    layer takes ~4x the mean load, as per-domain load statistics show at a trained model's balance);
  - token identity: early layers route mostly by the token id (OpenMoE's context-independent
    specialisation), so each vocabulary id has preferred experts per layer, followed with a
    probability falling from 0.5 at the first layer to 0.1 at the last; token ids are Zipf(1.1);
  - persistence: a slot keeps the previous token's expert with probability 0.25 (consecutive
    tokens share experts well above chance, as Mixtral's routing analysis shows).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from milestream.schemas import routing


def draw_routing(tokens: int, layers: int, top_k: int, experts: int, seed: int = 0, sigma: float = 0.5,
                 keep: float = 0.25, token_pull: tuple[float, float] = (0.5, 0.1), vocab: int = 8192,
                 zipf: float = 1.1) -> np.ndarray:
    """[tokens, layers, top_k] distinct expert ids per token and layer."""
    rng = np.random.default_rng(seed)
    popularity = np.exp(rng.normal(0.0, sigma, (layers, experts)))
    cdf = np.cumsum(popularity, axis=1) / popularity.sum(axis=1, keepdims=True)

    def popular(shape: tuple[int, ...]) -> np.ndarray:  # [*shape[:-1], layers, shape[-1]] by each layer's weights
        u = rng.random((layers, *shape))
        return np.moveaxis(np.stack([np.searchsorted(cdf[layer], u[layer]) for layer in range(layers)]), 0, -2)

    frequency = np.arange(1, vocab + 1, dtype=float) ** -zipf
    token_ids = rng.choice(vocab, tokens, p=frequency / frequency.sum())
    preferred = popular((vocab, top_k))[token_ids]
    pull = np.linspace(*token_pull, layers)[None, :, None]
    fresh = np.where(rng.random((tokens, layers, top_k)) < pull, preferred, popular((tokens, top_k)))
    renew = rng.random((tokens, layers, top_k)) >= keep
    renew[0] = True
    source = np.maximum.accumulate(np.where(renew, np.arange(tokens)[:, None, None], 0), axis=0)
    ids = np.sort(np.take_along_axis(fresh, source, axis=0), axis=2)
    while (clash := np.diff(ids, axis=2) == 0).any():  # a token's experts are distinct: redraw repeats
        ids[:, :, 1:][clash] = popular((tokens, top_k))[:, :, 1:][clash]
        ids = np.sort(ids, axis=2)
    return ids


def statistics(ids: np.ndarray, experts: int) -> dict:
    """Mean share of a token's experts also used by the previous token, and busiest expert / mean load."""
    tokens, layers, top_k = ids.shape
    overlap, peak = [], []
    for layer in range(layers):
        chosen = np.zeros((tokens, experts), dtype=bool)
        np.put_along_axis(chosen, ids[:, layer], True, axis=1)
        overlap.append((chosen[1:] & chosen[:-1]).sum(axis=1).mean() / top_k)
        load = chosen.sum(axis=0)
        peak.append(load.max() / load.mean())
    return {"consecutive_overlap": round(float(np.mean(overlap)), 3),
            "chance_overlap": round(top_k / experts, 3), "busiest_over_mean_load": round(float(np.mean(peak)), 2)}


def record_bytes(ids: np.ndarray, experts: int, plain: bool = False) -> int:
    if plain:  # the first wire layout: ids as sampled, narrow ints, zstd, same chunks
        width = routing.id_width(experts)
        compressor = routing.zstandard.ZstdCompressor(level=3)
        return sum(len(compressor.compress(np.ascontiguousarray(ids[s:s + 8192], dtype=routing._dtype(width)).tobytes()))
                   for s in range(0, len(ids), 8192))
    return sum(len(r.data) for r in routing.pack("t", "g", 0, 1, ids, experts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    args = parser.parse_args()
    ids = draw_routing(args.tokens, args.layers, args.top_k, args.experts)
    int32_bytes = ids.size * 4
    started = time.perf_counter()
    records = routing.pack("t", "g", 0, 1, ids, args.experts)
    pack_s = time.perf_counter() - started
    milestream_bytes = sum(len(r.data) for r in records)
    started = time.perf_counter()
    fields = routing.joined_fields(records)
    assert np.array_equal(routing.unpack(fields["routing_layout"], fields["routing_compression"],
                                         fields["routing_data"]), ids)
    unpack_s = time.perf_counter() - started
    uniform = draw_routing(args.tokens, args.layers, args.top_k, args.experts, seed=1, sigma=0.0, keep=0.0,
                           token_pull=(0.0, 0.0))
    print(json.dumps({
        "tokens": args.tokens, "layers": args.layers, "top_k": args.top_k, "experts": args.experts,
        "int32_bytes": int32_bytes, "milestream_bytes": milestream_bytes,
        "ratio": round(milestream_bytes / int32_bytes, 4), "goal_bytes": 8_000_000,
        "goal_met": milestream_bytes <= 8_000_000, "chunks": len(records),
        "first_layout_bytes": record_bytes(ids, args.experts, plain=True),
        "uniform_random_bytes": record_bytes(uniform, args.experts),
        "pack_s": round(pack_s, 3), "unpack_s": round(unpack_s, 3),
        "drawn": "per-layer log-normal expert popularity (sigma 0.5), token-id preferred experts followed with "
                 "p 0.5 (first layer) to 0.1 (last), Zipf(1.1) token ids over 8192, slot kept from the "
                 "previous token with p 0.25; distinct experts per token",
        **statistics(ids, args.experts),
    }))


if __name__ == "__main__":
    main()
