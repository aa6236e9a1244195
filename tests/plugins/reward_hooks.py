"""User rewards loaded by import path (reward.fn / reward.group_fn) in the reward tests."""
from __future__ import annotations

import asyncio


def length_penalty(sample) -> float:
    return 1.0 if sample.response.strip() == sample.label else -0.01 * len(sample.response)


async def graded(sample) -> dict[str, float]:
    await asyncio.sleep(0)
    return {"correct": float(sample.response.strip() == sample.label), "short": float(len(sample.response) < 5)}


async def slow(sample) -> float:
    await asyncio.sleep(5)
    return 1.0


def not_a_number(sample):
    return "high"


def fails_on_odd_rows(sample) -> float:
    """Raises for the prompts of odd rows: their groups must be dropped with reason reward_error."""
    if sample.metadata["row"] % 2:
        raise RuntimeError(f"no reward for row {sample.metadata['row']}")
    return 1.0


def pairwise(samples) -> list[float]:
    """1 for the longest response of the group, 0 for the others (a stand-in for a comparison model)."""
    longest = max(range(len(samples)), key=lambda i: len(samples[i].response))
    return [float(i == longest) for i in range(len(samples))]


async def pairwise_graded(samples) -> list[dict[str, float]]:
    return [{"longest": value, "bonus": 0.5} for value in pairwise(samples)]


def tool_use(sample) -> dict[str, float]:
    """Reads the episode's whole conversation: a point for each tool result it holds, one for the answer."""
    results = sum(message["role"] == "tool" for message in sample.transcript)
    return {"tool_results": float(results), "answered": float(sample.label in sample.response)}
