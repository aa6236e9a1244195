"""Built-in group filters for ``buffer.filter`` (any function of this shape can be named by import path)."""
from __future__ import annotations

from typing import Sequence

from milestream.schemas.records import GroupSample


def reward_nonzero_std(samples: Sequence[GroupSample]) -> tuple[bool, str]:
    """Keep a group only if its rewards differ: with GRPO an all-equal group has zero advantage."""
    rewards = {round(s.reward, 6) for s in samples}
    if len(rewards) > 1:
        return True, ""
    return False, f"all {len(samples)} rewards equal {next(iter(rewards))}"
