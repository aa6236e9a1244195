"""``milestream engine --engines N``: N engine servers, each its own freshly started process.

The children are started, not forked: once milestream's modules are imported, pyarrow's jemalloc runs a
background thread, and forking a process that runs threads is unsafe (a lock held at the fork stays held
in the child). A fresh interpreter costs each child its imports, paid in parallel; this parent imports
nothing heavy, and on one core the three engines are ready sooner than forked ones were.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from milestream.config import Config
from milestream.infra.secret_env import stage_environment
from milestream.infra.services import die_with_parent


def serve_engines(cfg: Config, *, host: str, port: int, engine_id: str, count: int) -> int:
    """Engines ``ENGINE_ID-0`` ... on ports ``port``, ``port + 1``, ... (port 0: free ones), each printing
    its ``engine ID serving URL`` line; when one exits, the others are stopped. Returns the worst exit code."""
    with tempfile.TemporaryDirectory(prefix="milestream-engines-") as folder:
        config = Path(folder) / "config.yaml"
        config.write_text(cfg.to_yaml())  # without secrets: the engines get them in their environment
        running, env = {}, stage_environment(cfg)
        for index in range(count):
            argv = [sys.executable, "-m", "milestream.cli", "engine", "--config", str(config), "--host", host,
                    "--port", str(port + index if port else 0), "--engine-id", f"{engine_id}-{index}"]
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
            running[child.pid] = child
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: _terminate(running.values()))
        worst = 0
        while running:
            pid, status = os.wait()
            if running.pop(pid, None) is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            if code != 0:  # one engine is gone: stop the others, so whoever waits for all of them hears of it
                _terminate(running.values())
                worst = worst or code
        return worst


def _terminate(children) -> None:
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGTERM)
