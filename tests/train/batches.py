"""Hand-made training batches on the tiny model, for the learner's and the losses' tests."""
from __future__ import annotations

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.schemas.records import GroupSample
from milestream.train.learner import CollectedGroup


def group(gid: str, prompt: list[int], rows: list[tuple[int, float]]) -> CollectedGroup:
    """(response length, reward) per sample; every token on the mask, rollout log-prob -2."""
    samples = [GroupSample(f"{gid}/{i}", gid, gid, i, len(rows), prompt, [5 + i + t for t in range(length)],
                           [1] * length, [0] * length, reward, "completed", "", "e", "w", 0.0, 0.0,
                           logprobs=[-2.0] * length)
               for i, (length, reward) in enumerate(rows)]
    return CollectedGroup(gid, samples, 0)


def tiny(**trainer) -> Config:
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32"}, rollout={"max_new_tokens": 5},
                                  trainer={"lr": 1e-2, **trainer})
    configure_process(cfg.model)
    return cfg
