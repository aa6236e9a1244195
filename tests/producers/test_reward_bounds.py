"""A reward cannot stall the rollout worker (producers/rewards.py, infra/process_pool.py): every verifier and
user function runs in a reward process, off the caller's event loop; one that outlasts reward.timeout_s is a
reward error with its process killed, and a busy one ends with its caller. The math verifier refuses
big-number arithmetic on the model's say-so. Each scenario ends at a hang guard, so a reward that blocked
its caller would fail the test, not hang it: scoring runs in a process of its own where it could hold the
GIL (a big power, a backtracking regex), else on an event loop in a daemon thread."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

import pytest

from milestream.config import Config
from milestream.producers.rewards import Reward, RewardSample, load_reward

PLUGINS = str(Path(__file__).parents[1] / "plugins")
HANG_S = 120.0  # a hang guard only: each scenario ends in seconds


def reward_sample(response: str, label: str = "1", **metadata: str) -> RewardSample:
    return RewardSample(source="qa", prompt="q", messages=({"role": "user", "content": "q"},), response=response,
                        label=label, metadata=metadata)


SCORE = """
import asyncio, json, sys
from dataclasses import asdict
from milestream.config import Config
from milestream.producers.rewards import RewardSample, load_reward
knobs, samples = json.loads(sys.argv[1]), [RewardSample(**each) for each in json.loads(sys.argv[2])]
print(json.dumps([asdict(r) for r in asyncio.run(load_reward(Config().with_overrides(reward=knobs))(samples))]))
"""


SPIN = """
import asyncio, sys
from milestream.config import Config
from milestream.producers.rewards import RewardSample, load_reward
reward = load_reward(Config().with_overrides(reward={"fn": "reward_hangs:spins_forever", "timeout_s": 3600}))
sample = RewardSample("qa", "q", (), "spin", "1", {"pid_file": sys.argv[1]})
asyncio.run(reward([sample]))
"""


def scored_apart(knobs: dict, *samples: RewardSample) -> list[Reward]:
    try:
        command = [sys.executable, "-c", SCORE, json.dumps(knobs), json.dumps([asdict(each) for each in samples])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scoring did not end within {HANG_S:g} s")
    assert done.returncode == 0, done.stderr
    return [Reward(**each) for each in json.loads(done.stdout.splitlines()[-1])]


def within_hang_guard(scenario: Callable[[], Awaitable[list[Reward]]]) -> list[Reward]:
    done: list[list[Reward]] = []
    threading.Thread(target=lambda: done.append(asyncio.run(scenario())), daemon=True).start()
    wait_until(lambda: done, "scoring to end: it blocked its event loop")
    return done[0]


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_S:g} s"
        time.sleep(0.05)


def process_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_huge_boxed_number_is_compared_as_text_not_computed() -> None:
    samples = [reward_sample(f"\\boxed{{1e{exponent}}}", label=label)
               for exponent in ("10000000", "1000000000") for label in (f"1e{exponent}", "1")]
    rewards = scored_apart({"verifier": "math"}, *samples)
    assert rewards == [Reward(1.0), Reward(0.0)] * 2  # a correct refusal: no error, no arithmetic


def test_a_catastrophic_regex_is_a_reward_error_after_the_timeout() -> None:
    knobs = {"verifier": "regex", "pattern": r"^(a+)+$", "timeout_s": 1.0}
    assert scored_apart(knobs, reward_sample("a" * 64 + "b")) == [Reward(0.0, error="timed out after 1.0s")]


def test_a_reward_that_never_returns_is_an_error_and_its_process_is_killed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    reward = load_reward(Config().with_overrides(reward={"fn": "reward_hangs:spins_forever", "timeout_s": 1.0}))
    pid_file = tmp_path / "pid"

    async def scenario() -> list[Reward]:
        first = await reward([reward_sample("spin", pid_file=str(pid_file)), reward_sample("fine")])
        return first + await reward([reward_sample("fine")])  # a fresh process took the killed one's place

    hung, fine, again = within_hang_guard(scenario)
    assert hung == Reward(0.0, error="timed out after 1.0s") and fine == again == Reward(1.0)
    pid = int(pid_file.read_text())
    wait_until(lambda: process_gone(pid), f"the reward's process {pid} to be killed after its timeout")


def test_the_event_loop_serves_while_a_reward_holds_its_own(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(PLUGINS)
    reward = load_reward(Config().with_overrides(reward={"fn": "reward_hangs:holds_its_loop"}))
    started, release = tmp_path / "started", tmp_path / "release"

    async def scenario() -> list[Reward]:
        scoring = asyncio.ensure_future(reward([reward_sample("7", started=str(started), release=str(release))]))
        while not started.exists():  # runs only while the event loop is free: the reward holds another
            await asyncio.sleep(0.01)
        release.touch()
        return await scoring

    assert within_hang_guard(scenario) == [Reward(1.0)]


def test_a_busy_reward_process_dies_with_its_caller(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", PLUGINS)
    pid_file = tmp_path / "pid"
    caller = subprocess.Popen([sys.executable, "-c", SPIN, str(pid_file)])
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the reward to start spinning")
    finally:
        caller.kill()
        caller.wait()
    pid = int(pid_file.read_text())
    try:
        wait_until(lambda: process_gone(pid), f"the reward's process {pid} to end with its SIGKILLed caller")
    finally:
        if not process_gone(pid):  # this test's failure: the spinner is not left eating a core
            os.kill(pid, signal.SIGKILL)
