"""``milestream run`` from a test: its summary, or, when it fails, the tail of each stage's log."""
from __future__ import annotations

from pathlib import Path

from milestream.orchestrator import run_loop


def run_showing_logs(cfg) -> dict:
    try:
        return run_loop(cfg)
    except BaseException:
        for log in sorted((Path(cfg.run.run_dir) / "logs").glob("*.log")):
            print(f"==== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
        raise
