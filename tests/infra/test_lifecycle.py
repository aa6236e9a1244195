"""How a stage is told to stop (infra/lifecycle.py): a SIGTERM during its set-up is kept for its first look at
``stop``, and the stage stops in order then; a second SIGTERM ends a stage whose set-up never looks (one
waiting on a broker that is gone) at once. The same in a stage's asyncio loop."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

STAGE = textwrap.dedent("""
    import asyncio, pathlib, sys, time
    from milestream.infra.lifecycle import async_stop, stop_on_signals

    folder, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    stop = stop_on_signals()
    (folder / "setting-up").touch()
    while not (folder / "set-up").exists():  # a set-up that never looks at stop
        time.sleep(0.01)
    if mode == "async":
        async def main():
            await async_stop(stop).wait()
        asyncio.run(main())
    elif not stop.is_set():
        sys.exit(3)
    (folder / "stopped-in-order").touch()
""")


def start_stage(tmp_path: Path, mode: str) -> subprocess.Popen:
    stage = subprocess.Popen([sys.executable, "-c", STAGE, str(tmp_path), mode])
    while not (tmp_path / "setting-up").exists():
        assert stage.poll() is None
    return stage


def test_a_signal_during_set_up_stops_the_stage_in_order_when_it_looks(tmp_path):
    for mode in ("sync", "async"):
        stage = start_stage(tmp_path, mode)
        stage.send_signal(signal.SIGTERM)
        (tmp_path / "set-up").touch()
        assert stage.wait(60) == 0
        assert (tmp_path / "stopped-in-order").exists()
        for name in ("setting-up", "set-up", "stopped-in-order"):
            (tmp_path / name).unlink()


def test_a_second_signal_ends_a_set_up_that_never_looks(tmp_path):
    stage = start_stage(tmp_path, "sync")
    stage.send_signal(signal.SIGTERM)
    stage.send_signal(signal.SIGINT)
    assert stage.wait(60) in (128 + signal.SIGINT, 128 + signal.SIGTERM)  # both pending: handled in number order
    assert not (tmp_path / "stopped-in-order").exists()
