"""Concurrent multi-turn chat sessions through the session service and the affinity router, against
the same turns sent straight to the engines.

Processes, each started as ``milestream``: ``--engines`` CPU engine servers on the tiny model, the router
in front of them, and the session service whose backend is the router
(``milestream.engines.http_engine:router_backend``). Every one of ``--sessions`` sessions is opened at
once and runs ``--turns`` chat turns one after the other (max_new_tokens 4), then is closed. The
baseline, measured next in the same run, replays the very same token inputs of every turn (read from
the closed sessions' samples) straight to the engines' /generate, session i on engine i mod E, with
the same concurrency and client library (aiohttp). Prints one JSON line:

  errors / timeouts       turns that failed, and of those, turns with no reply within --timeout-s
  p50_ms / p99_ms         latency of one chat turn; baseline: of one /generate of the same input
  turns_s, wall_s         over the whole load; ratio_*: through the service and router over straight
  cpu_s                   CPU seconds the router, the service and the engines (together) used in the load
  peak_rss_mb             VmHWM of the router, the service and each engine after the service phase
  rss_mb_before / _after  VmRSS of the router and the service before and after the load
  router_sessions_after   routing keys the router still holds once the sessions closed (closing one
                          releases its key); service_sessions_after: sessions the service still holds

    .venv/bin/python benchmarks/sessions_load.py [--sessions 50] [--turns 3] [--engines 2] [--timeout-s 120]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from milestream.config import ModelConfig
from milestream.engines.http_api import raise_open_files_limit
from milestream.infra.model import load_tokenizer
from milestream.producers.sessions.templates import chat_template
from milestream_testkit.servers import CONTROL_HEADERS, MODEL, ready_urls, start, stop

MAX_NEW_TOKENS = 4


def memory_mb(pid: int, field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise ValueError(f"/proc/{pid}/status has no {field}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1) if ordered else float("nan")


class Tally:
    """Latencies of the turns that succeeded; failures, and of them the ones that timed out."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors = self.timeouts = 0
        self.first_error = ""

    async def timed(self, call) -> dict | None:
        started = time.monotonic()
        try:
            status, reply = await call()
        except asyncio.TimeoutError:
            status, reply = None, {"error": "no reply within the client's timeout"}
        except aiohttp.ClientError as exc:
            status, reply = None, {"error": f"{type(exc).__name__}: {exc}"}
        if status == 200:
            self.latencies.append(time.monotonic() - started)
            return reply
        self.errors += 1
        message = str(reply.get("error") or reply.get("message") or reply)
        self.timeouts += "no reply within" in message
        self.first_error = self.first_error or f"HTTP {status}: {message}"
        return None

    def figures(self, wall_s: float) -> dict:
        return {"errors": self.errors, "timeouts": self.timeouts, "p50_ms": percentile(self.latencies, 0.5),
                "p99_ms": percentile(self.latencies, 0.99), "wall_s": round(wall_s, 2),
                "turns_s": round(len(self.latencies) / wall_s, 1), "first_error": self.first_error or None}


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as reply:
        return reply.status, await reply.json(content_type=None)


async def one_session(http: aiohttp.ClientSession, service: str, index: int, turns: int, tally: Tally) -> dict | None:
    """Open, ``turns`` chat turns, close: the session's one sample (its token history), or None."""
    status, opened = await post(http, service + "/sessions", {})
    if status != 201:
        tally.errors += 1
        return None
    chat = f"{service}/sessions/{opened['session_id']}"
    messages = [{"role": "user", "content": f"Question {index}: what is {index} + 1?"}]
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0}
    for turn in range(turns):
        reply = await tally.timed(lambda: post(http, chat + "/chat", {"messages": messages, "sampling": sampling}))
        if reply is None:
            break
        messages = [*messages, reply["message"], {"role": "user", "content": f"And then, step {turn + 2}?"}]
    async with http.delete(chat) as closed:
        samples = (await closed.json())["samples"]
    return {"id": opened["session_id"], "sample": samples[0] if samples else None}


def turn_inputs(sample: dict) -> list[list[int]]:
    """Each generated turn's input ids: every token before the turn's first generated one."""
    ids = sample["prompt_ids"] + sample["response_ids"]
    mask = [0] * len(sample["prompt_ids"]) + sample["loss_mask"]
    return [ids[:at] for at in range(len(ids)) if mask[at] == 1 and mask[at - 1] == 0]


async def straight_session(http: aiohttp.ClientSession, engine: str, inputs: list[list[int]], stop_id: int,
                           tally: Tally) -> None:
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 1.0, "stop_token_ids": [stop_id]}
    for input_ids in inputs:
        body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}
        if await tally.timed(lambda: post(http, engine + "/generate", body)) is None:
            return


def client(timeout_s: float) -> aiohttp.ClientSession:
    # no pool limit (aiohttp's default is 100 connections): every session has its turn in flight at once
    # with the run's control token: every route of the session service needs it
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=CONTROL_HEADERS,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def load(urls: dict, pids: dict, args: argparse.Namespace, stop_id: int) -> dict:
    async with client(args.timeout_s + 10) as http:
        for engine in urls["engines"]:  # the first forward of each engine pays torch's warm-up: not measured
            await post(http, engine + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        before = {name: memory_mb(pids[name], "VmRSS") for name in ("router", "sessions")}
        every = {"router": [pids["router"]], "sessions": [pids["sessions"]], "engines": pids["engines"]}
        cpu_before = {name: sum(map(cpu_s, group)) for name, group in every.items()}
        via, started = Tally(), time.monotonic()
        closed = await asyncio.gather(*(one_session(http, urls["sessions"], i, args.turns, via)
                                        for i in range(args.sessions)))
        via_wall = time.monotonic() - started
        cpu = {name: round(sum(map(cpu_s, group)) - cpu_before[name], 1) for name, group in every.items()}
        after = {name: memory_mb(pids[name], "VmRSS") for name in ("router", "sessions")}
        peak = {name: memory_mb(pids[name], "VmHWM") for name in ("router", "sessions")}
        peak["engines"] = [memory_mb(pid, "VmHWM") for pid in pids["engines"]]
        async with http.get(urls["router"] + "/get_server_info") as reply:
            router_left = (await reply.json())["sessions"]
        service_left = 0
        for session in filter(None, closed):
            async with http.get(f"{urls['sessions']}/sessions/{session['id']}/samples") as reply:
                service_left += reply.status == 200
        straight, started = Tally(), time.monotonic()
        engines = urls["engines"]
        await asyncio.gather(*(straight_session(http, engines[i % len(engines)], turn_inputs(s["sample"]), stop_id,
                                                straight) for i, s in enumerate(closed) if s and s["sample"]))
        straight_wall = time.monotonic() - started
    return {"via": {**via.figures(via_wall), "cpu_s": cpu}, "straight": straight.figures(straight_wall), "before": before,
            "after": after, "peak": peak, "router_left": router_left, "service_left": service_left}


def start_fleet(logs: Path, args: argparse.Namespace) -> tuple[list[subprocess.Popen], dict]:
    """The engines, the router over them and the session service over the router; their URLs."""
    processes = [start(["engine", "--port", "0", "--engine-id", f"b-{i}", *MODEL], logs / f"b-{i}.log")
                 for i in range(args.engines)]
    urls: dict = {"engines": [ready_urls(p, 1, logs / f"b-{i}.log")[f"engine b-{i}"] for i, p in enumerate(processes)]}
    timeout = ["--set", f"router.request_timeout_s={args.timeout_s}"]
    processes.append(start(["router", "--set", f"router.engines=[{', '.join(urls['engines'])}]",
                            "--set", "router.port=0", *timeout], logs / "router.log"))
    urls["router"] = ready_urls(processes[-1], 1, logs / "router.log")["router"]
    processes.append(start(["sessions", *MODEL, *timeout, "--set", "router.port=" + urls["router"].rsplit(":", 1)[1],
                            "--set", "sessions.backend=milestream.engines.http_engine:router_backend",
                            "--set", "sessions.port=0", "--set", f"sessions.max_sessions={max(1024, args.sessions)}"],
                           logs / "sessions.log"))
    urls["sessions"] = ready_urls(processes[-1], 1, logs / "sessions.log")["sessions"]
    return processes, urls


def fleet_args(doc: str, count_flag: str, count: int, turns: int, timeout_s: float) -> argparse.Namespace:
    """The command line of a load on the fleet: how many sessions (``count_flag``), turns, engines, timeout."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument(count_flag, dest="sessions", type=int, default=count)
    parser.add_argument("--turns", type=int, default=turns)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=timeout_s, help="router.request_timeout_s; clients wait 10 s more")
    return parser.parse_args()


def on_fleet(args: argparse.Namespace, load: Callable[[dict, list[subprocess.Popen], int], Awaitable[dict]]) -> dict:
    """``load(urls, processes, stop id)`` on a fleet started for it and stopped after."""
    raise_open_files_limit()  # the client holds a connection per session too
    stop_id = chat_template(load_tokenizer(ModelConfig(name="tiny-random"))).end_of_turn_id
    with tempfile.TemporaryDirectory(prefix="sessions-load-") as logs:
        processes, urls = start_fleet(Path(logs), args)
        try:
            return asyncio.run(load(urls, processes, stop_id))
        finally:
            for process in reversed(processes):
                stop(process)


def main() -> None:
    args = fleet_args(__doc__, "--sessions", 50, 3, 120.0)

    def pids(processes: list[subprocess.Popen]) -> dict:
        return {"engines": [p.pid for p in processes[:args.engines]], "router": processes[-2].pid,
                "sessions": processes[-1].pid}

    result = on_fleet(args, lambda urls, processes, stop_id: load(urls, pids(processes), args, stop_id))
    via, straight = result["via"], result["straight"]
    print(json.dumps({
        "sessions": args.sessions, "turns": args.turns, "engines": args.engines, **via,
        "baseline": straight,
        "ratio_wall": round(via["wall_s"] / straight["wall_s"], 2),
        "ratio_p50": round(via["p50_ms"] / straight["p50_ms"], 2),
        "ratio_p99": round(via["p99_ms"] / straight["p99_ms"], 2),
        "peak_rss_mb": result["peak"], "rss_mb_before": result["before"], "rss_mb_after": result["after"],
        "router_sessions_after": result["router_left"], "service_sessions_after": result["service_left"],
    }))


if __name__ == "__main__":
    main()
