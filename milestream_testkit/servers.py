"""Server processes for the engine tests and benchmarks/sessions_load.py: started as ``milestream``
subprocesses, each its own process group, and waited for by the ``NAME serving URL`` line each prints
once it listens. Every one is given ``CONTROL_TOKEN`` as the run's control token (in its environment, as
``milestream run`` hands secrets to its stages); ``post_json`` sends it."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp

from milestream.config import ENV_PREFIX
from milestream.engines.http_api import ROUTING_KEY_HEADER, authorization

CONTROL_TOKEN = "milestream-test-control-token"
CONTROL_HEADERS = authorization(CONTROL_TOKEN)
MODEL = ["--set", "model.name=tiny-random", "--set", "model.dtype=float32", "--set", "model.lora_rank=0"]


def start(args: list[str], log: Path) -> subprocess.Popen:
    # its own process group, with faulthandler on: a hung server is sent SIGABRT and its stacks land in its log
    return subprocess.Popen([sys.executable, "-m", "milestream.cli", *args], stdout=subprocess.PIPE,
                            stderr=log.open("a"), text=True, start_new_session=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1",
                                 f"{ENV_PREFIX}RUN__CONTROL_TOKEN": CONTROL_TOKEN})


def ready_urls(process: subprocess.Popen, count: int, log: Path, hang_guard_s: float = 300.0) -> dict[str, str]:
    """``{name: url}`` from the ``NAME serving URL`` lines a server prints once it listens; a server that
    dies, or hangs (``hang_guard_s`` without a line), fails the fixture with its log instead of blocking."""
    lines: queue.Queue[str] = queue.Queue()

    def forward_lines() -> None:  # also keeps the pipe drained for as long as the server runs
        for line in process.stdout:
            lines.put(line)
        lines.put("")  # end of output: the server exited

    threading.Thread(target=forward_lines, daemon=True).start()
    urls = {}
    while len(urls) < count:
        try:
            line = lines.get(timeout=hang_guard_s)
        except queue.Empty:
            os.killpg(process.pid, signal.SIGABRT)  # every process of the server writes its stacks
            process.wait(timeout=30)
            raise RuntimeError(f"no server ready after {hang_guard_s:.0f} s: {log.read_text()[-3000:]}") from None
        if not line:
            raise RuntimeError(f"server exited before it was ready: {log.read_text()[-3000:]}")
        if " serving " in line:
            name, url = line.strip().rsplit(" serving ", 1)
            urls[name] = url
    return urls


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as reply:
        assert reply.status == 200, await reply.text()
        return await reply.json()


async def post_json(http: aiohttp.ClientSession, url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {**CONTROL_HEADERS, **({ROUTING_KEY_HEADER: key} if key is not None else {})}
    async with http.post(url, json=body, headers=headers) as reply:
        return reply.status, await reply.json()
