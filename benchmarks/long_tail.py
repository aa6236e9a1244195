"""A generate function (``rollout.generate_fn``) with long-tailed response lengths, whatever the model writes.

Each sample's length is drawn from a lognormal with median ``rollout.max_new_tokens / 8`` and sigma 1,
capped at ``rollout.max_new_tokens``, seeded by its request id, so every schedule of
``benchmarks/schedules.py`` generates the same lengths for the same prompts; the stop tokens are off, so
the engine generates exactly that many tokens. About 1 sample in 12 runs past 4 x the median: the
stragglers a synchronous schedule waits for.
"""
from __future__ import annotations

import dataclasses
import math
import random
import zlib

from milestream.producers.rollout import RolloutContext, Sample, single_turn
from milestream.schemas.records import Prompt

SIGMA = 1.0


def drawn_length(request_id: str, cap: int) -> int:
    rng = random.Random(zlib.crc32(request_id.encode()))
    return max(1, min(cap, round(rng.lognormvariate(math.log(cap / 8), SIGMA))))


async def lognormal_length(ctx: RolloutContext, prompt: Prompt, request_id: str) -> Sample:
    sampling = dataclasses.replace(ctx.sampling, stop_token_ids=(),
                                   max_new_tokens=drawn_length(request_id, ctx.sampling.max_new_tokens))
    return await single_turn(ctx, prompt, request_id, sampling)
