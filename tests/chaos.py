"""Finding and killing the stages of a running ``milestream run``, as a crash would: for the crash
tests and benchmarks/resume.py. A stage is ``python -m milestream.cli COMMAND --config RUN/config.yaml``."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def pids(*words: str) -> list[int]:
    """Processes whose command line holds every word as a whole argument."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if all(word in argv for word in words):
            found.append(int(entry.name))
    return found


def stage_pids(config_path: str | Path, command: str) -> list[int]:
    """The processes of one stage of the run whose configuration is ``config_path``."""
    return pids("milestream.cli", command, str(config_path))


def sigkill(pid: int) -> bool:
    """SIGKILL: no handler runs, nothing is flushed. False when the process was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
