"""The recipe's reward (``reward.fn: examples.recipe.reward:score``): two components, each a metric.

``correct``: the last number before the closing answer tag is the label; ``format``: the tag was closed
(the answer is easy to find). The trained reward is their sum (no ``reward.key`` in config.yaml).
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(sample) -> dict[str, float]:
    answer, closed, _ = sample.response.partition("</answer>")
    numbers = _NUMBER.findall(answer)
    correct = bool(numbers) and float(numbers[-1]) == float(sample.label)
    return {"correct": float(correct), "format": 0.1 if closed else 0.0}
