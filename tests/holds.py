"""The test's side of milestream/infra/faults.py: arm a named hold point, wait until a stage holds
there (its state cannot move while it does), act, then release it or kill it."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from pathlib import Path

from milestream.infra.faults import HOLD_DIR


class Holds:
    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    @classmethod
    def enable(cls, monkeypatch, tmp_path: Path) -> "Holds":
        """Hold points on for this process and every stage it starts from now on."""
        holds = cls(tmp_path / "holds")
        monkeypatch.setenv(HOLD_DIR, str(holds.directory))
        return holds

    def arm(self, point: str, at_pass: int = 1) -> None:
        """The first process to pass ``point`` ``at_pass`` times from now on holds there."""
        staging = self.directory / f".{point}.arming"
        staging.write_text(str(at_pass))
        staging.rename(self.directory / point)  # whole or not at all: a stage never reads half of it

    def wait_held(self, point: str, timeout_s: float, check: Callable[[], None] = lambda: None,
                  besides: Collection[int] = ()) -> int:
        """The pid holding at ``point`` (other than those ``besides``, still held there), once one does;
        ``check`` raises if waiting is pointless."""
        deadline = time.monotonic() + timeout_s
        while not (held := [pid for pid in self.holders(point) if pid not in besides]):
            check()
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for a stage to hold at {point}")
            time.sleep(0.1)
        return held[0]

    def holders(self, point: str) -> list[int]:
        return [int(path.name.rsplit(".", 1)[1]) for path in self.directory.glob(f"{point}.held.*")]

    def release(self, point: str, pid: int) -> None:
        """Let the holder go on; also forgets the hold of a process that was killed there."""
        (self.directory / f"{point}.held.{pid}").unlink(missing_ok=True)

    def fail(self, point: str) -> None:
        """Every process that passes ``point`` raises there until ``recover``."""
        (self.directory / f"{point}.fail").touch()

    def recover(self, point: str) -> None:
        (self.directory / f"{point}.fail").unlink(missing_ok=True)

    def release_all(self) -> None:
        """Disarm, release and recover everything: a failed test leaves no stage held behind it."""
        for path in self.directory.iterdir():
            path.unlink(missing_ok=True)


def update_mid_generation(engine, requests, update: dict, holds: Holds, at_step: int,
                          hang_guard_s: float = 300.0) -> list:
    """The requests join one step of ``engine`` (a CpuEngine); it is held after its ``at_step``-th step while
    version 1 (``update``) lands, then let go: the requests' results."""

    async def run() -> list:
        await engine.pause()  # queued while paused: all of them join the first step
        tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
        await asyncio.sleep(0)  # each task runs to its first await: its request is queued
        holds.arm("engine.stepped", at_pass=at_step)
        await engine.resume()
        held_by = await asyncio.to_thread(holds.wait_held, "engine.stepped", hang_guard_s)
        await engine.update_weights(1, update)
        holds.release("engine.stepped", held_by)
        return list(await asyncio.gather(*tasks))

    return asyncio.run(run())
