"""The step's mismatch breakdown (train/mismatch_breakdown.py): rollout log-probs planted at known
distances from the trainer's own, and the figures by position, lag and token worked out from them."""
from __future__ import annotations

import math

import pytest

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.schemas.records import GroupSample
from milestream.train.learner import CollectedGroup, Learner

VERSION = 3  # pi_old's
HOT = 77  # the token planted with the largest distance
# group -> (prompt, [(response length, token versions, masked-out position or None)], staleness)
GROUPS = {
    "a": ([1, 2, 3], [(70, [2] * 70, None), (20, [1] * 10 + [3] * 10, 5)], 2),
    "b": ([4, 5], [(5, [3] * 5, None), (5, [3] * 5, None)], 0),
}


def response(length: int, seed: int) -> list[int]:
    ids = [10 + (seed * 7 + t * 3) % 50 for t in range(length)]
    return [HOT if t % 9 == 4 else token for t, token in enumerate(ids)]


def offset(token: int, position: int, sample: int) -> float:
    """rollout - trainer log-prob of a token: the sign alternates by sample, HOT is far off."""
    return 0.5 if token == HOT else (0.001 * (position % 13 + 1) * (1 if sample % 2 else -1))


def batch(learner: Learner) -> tuple[list[CollectedGroup], list[tuple[int, int, int, float]]]:
    """The groups, rollout log-probs planted; and each masked token's (position, lag, id, |planted|)."""
    out, tokens = [], []
    for gid, (prompt, shapes, staleness) in GROUPS.items():
        responses = [response(length, len(out) * 2 + i) for i, (length, _, _) in enumerate(shapes)]
        trainer = learner.backend.logprobs(prompt, responses, 1.0).detach()
        samples = []
        for i, ((length, versions, hole), ids) in enumerate(zip(shapes, responses)):
            mask = [0 if t == hole else 1 for t in range(length)]
            planted = [offset(ids[t], t, i) if mask[t] else 5.0 for t in range(length)]
            logprobs = [float(trainer[i, t]) + planted[t] for t in range(length)]
            samples.append(GroupSample(f"{gid}/{i}", gid, gid, i, len(shapes), prompt, ids, mask, versions, float(i),
                                       "completed", "", "e", "w", 0.0, 0.0, logprobs=logprobs))
            tokens += [(t, VERSION - versions[t], ids[t], abs(planted[t])) for t in range(length) if mask[t]]
        out.append(CollectedGroup(gid, samples, staleness))
    return out, tokens


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("updates", [1, 2])
def test_the_breakdown_by_position_lag_and_token(updates: int) -> None:
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32", "lora_rank": 0, "seed": 3},
                                  trainer={"updates_per_batch": updates, "lr": 0.0})
    configure_process(cfg.model)
    learner = Learner(cfg)
    groups, tokens = batch(learner)
    figures = learner.train_step(groups)
    breakdown = {k: v for k, v in figures.items() if k.startswith("logprob_diff_")}

    expected = {
        "logprob_diff_pos_0_15": mean([d for t, _, _, d in tokens if t < 16]),
        "logprob_diff_pos_16_63": mean([d for t, _, _, d in tokens if 16 <= t < 64]),
        "logprob_diff_pos_64_255": mean([d for t, _, _, d in tokens if t >= 64]),
        "logprob_diff_lag_0": mean([d for _, lag, _, d in tokens if lag == 0]),
        "logprob_diff_lag_1": mean([d for _, lag, _, d in tokens if lag == 1]),
        "logprob_diff_lag_2_up": mean([d for _, lag, _, d in tokens if lag >= 2]),
    }
    by_token: dict[int, list[float]] = {}
    for _, _, token, d in tokens:
        by_token.setdefault(token, []).append(d)
    tops = [int(breakdown.pop(f"logprob_diff_top{rank}_token")) for rank in range(1, 6)]
    assert tops[0] == HOT
    # the next four by their summed distance (some sums differ by float rounding alone: no order among them)
    top = sorted((sum(diffs) for diffs in by_token.values()), reverse=True)[:5]
    for rank, token in enumerate(tops, start=1):
        assert breakdown.pop(f"logprob_diff_top{rank}_count") == len(by_token[token])
        assert math.isclose(breakdown.pop(f"logprob_diff_top{rank}_sum"), sum(by_token[token]), rel_tol=1e-4)
        assert math.isclose(sum(by_token[token]), top[rank - 1], rel_tol=1e-4)
    assert breakdown.keys() == expected.keys()  # no token at 256+: no such bucket
    for name, value in expected.items():
        assert math.isclose(breakdown[name], value, rel_tol=1e-4), name
    # the position buckets split logprob_diff's tokens: their counts weigh them back into it
    counts = [sum(1 for t, *_ in tokens if lo <= t < hi) for lo, hi in ((0, 16), (16, 64), (64, 256))]
    weighed = sum(n * breakdown[k] for n, k in zip(counts, ("logprob_diff_pos_0_15", "logprob_diff_pos_16_63",
                                                            "logprob_diff_pos_64_255")))
    assert math.isclose(weighed / len(tokens), figures["logprob_diff"], rel_tol=1e-5)


def test_no_breakdown_without_a_rollout_mismatch_figure() -> None:
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32"},
                                  trainer={"objective": "supervised"})
    configure_process(cfg.model)
    learner = Learner(cfg)
    groups, _ = batch(learner)
    assert not [k for k in learner.train_step(groups) if k.startswith("logprob_diff")]
