"""User rewards that never end on their own (tests/producers/test_reward_bounds.py); the files they signal
through come in the sample's metadata."""
from __future__ import annotations

import os
from pathlib import Path


def spins_forever(sample) -> float:
    """1 for the response "fine"; otherwise records its process id and computes without end."""
    if sample.response == "fine":
        return 1.0
    Path(sample.metadata["pid_file"]).write_text(str(os.getpid()))
    while True:
        pass


async def holds_its_loop(sample) -> float:
    """An async reward that never awaits: it says it started, then holds whatever event loop runs it until
    the release file exists."""
    Path(sample.metadata["started"]).touch()
    while not os.path.exists(sample.metadata["release"]):
        pass
    return 1.0
