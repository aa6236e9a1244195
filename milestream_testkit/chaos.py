"""Finding and killing the stages and services of a running ``milestream run``, as a crash would: for the
crash tests, benchmarks/resume.py and benchmarks/chaos.py.

A stage is ``python -m milestream.cli COMMAND --config RUN/config.yaml``; the embedded broker and Redis
are found by the ports the run's configuration names."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from urllib.parse import urlparse

from milestream.config import Config, load_config

# what benchmarks/chaos.py can kill: a stage by its command, and the two embedded services
STAGES = {"rollout": "rollout", "processor": "process", "trainer": "train", "archiver": "archive",
          "loader": "load-prompts", "verifier": "verify-weights", "metrics": "metrics", "evaluator": "eval",
          "tracker": "track", "teacher": "teacher", "vllm": "serve-vllm"}
SERVICES = ("broker", "redis")


def _argv(pid: str) -> list[str] | None:
    try:
        return Path("/proc", pid, "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None


def pids(*words: str) -> list[int]:
    """Processes whose command line holds every word as a whole argument."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (argv := _argv(entry.name)) is not None and all(w in argv for w in words):
            found.append(int(entry.name))
    return found


def stage_pids(config_path: str | Path, command: str) -> list[int]:
    """The processes of one stage of the run whose configuration is ``config_path``."""
    return pids("milestream.cli", command, str(config_path))


def broker_pids(cfg: Config) -> list[int]:
    """The embedded broker (tansu) listening where ``cfg`` points."""
    return pids("broker", f"tcp://{cfg.broker.bootstrap_servers}")


def redis_pids(cfg: Config) -> list[int]:
    """The embedded redis-server listening where ``cfg`` points. It rewrites its command line to
    ``redis-server 127.0.0.1:PORT`` once it runs; before that, ``--port PORT`` is still there."""
    port = urlparse(cfg.redis.url).port
    found = []
    for entry in Path("/proc").iterdir():
        argv = _argv(entry.name) if entry.name.isdigit() else None
        line = " ".join(argv or ())
        if "redis-server" in line and (f"127.0.0.1:{port} " in f"{line} " or f"--port {port} " in line):
            found.append(int(entry.name))
    return found


def targets(config_path: str | Path) -> dict[str, list[int]]:
    """Every stage and embedded service of a running run that has a live process, by name."""
    cfg = load_config(config_path)
    found = {name: stage_pids(config_path, command) for name, command in STAGES.items()}
    found["broker"], found["redis"] = broker_pids(cfg), redis_pids(cfg)
    return {name: ids for name, ids in found.items() if ids}


def sigkill(pid: int) -> bool:
    """SIGKILL: no handler runs, nothing is flushed. False when the process was already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False
