"""Concurrent agent episodes through the OpenAI-compatible endpoint with the ``openai`` client, against the
same turns sent straight to the engines.

The fleet is sessions_load.py's: ``--engines`` CPU engine servers on the tiny model, the router in front of
them, the session service over the router. Every one of ``--episodes`` episodes opens a session and runs
``--turns`` chat turns one after the other through ``openai.AsyncOpenAI(base_url=".../sessions/ID/v1")``
(``chat.completions.create``, max_tokens 4, the reply appended as the client returned it), then closes
it. The baseline, measured next in the same run, replays the very same token inputs of every turn (read
from the closed sessions' samples) straight to the engines' /generate, episode i on engine i mod E, with the
same concurrency. Prints one JSON line:

  errors / timeouts       turns that failed, and of those, turns with no reply within --timeout-s
  p50_ms / p99_ms         latency of one turn; baseline: of one /generate of the same input
  turns_s, wall_s         over the whole load; ratio_*: through the endpoint over straight
  endpoint_with_aiohttp   the same episodes through the endpoint again, each request the same JSON sent with aiohttp
                          (the baseline's client library): what the endpoint costs without the openai client's
                          own CPU on the same cores; ratio_*_aiohttp: it over straight
  tito_broken             episodes whose sample is not one leaf (a turn's history was not matched: re-tokenized)
  cpu_s                   CPU seconds during the endpoint's load of this client (the openai client, httpx and
                          its pool), the session service, the router and the engines (together)

    .venv/bin/python benchmarks/openai_load.py [--episodes 1000] [--turns 2] [--engines 2] [--timeout-s 600]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from typing import Any

import aiohttp
import httpx
import openai

from milestream_testkit.servers import CONTROL_TOKEN
from sessions_load import (MAX_NEW_TOKENS, Tally, client, cpu_s, fleet_args, on_fleet, post, straight_session,
                           turn_inputs)


async def openai_turn(agent: openai.AsyncOpenAI, messages: list) -> tuple[int | None, dict | object]:
    """(status, the completion or an error) of one turn, as Tally.timed takes it."""
    try:
        return 200, await agent.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_NEW_TOKENS)
    except openai.APITimeoutError:
        return None, {"error": "no reply within the client's timeout"}
    except openai.APIStatusError as exc:
        return exc.status_code, {"error": exc.message}
    except openai.APIConnectionError as exc:
        return None, {"error": f"{type(exc).__name__}: {exc.__cause__ or exc}"}


async def one_episode(http: aiohttp.ClientSession, transport: httpx.AsyncClient | None, service: str, index: int,
                      turns: int, tally: Tally) -> list[dict] | None:
    """Open a session, ``turns`` turns through the openai client (``transport`` None: the same requests as JSON
    with aiohttp, the baseline's client), close: the session's samples, or None."""
    status, opened = await post(http, service + "/sessions", {})
    if status != 201:
        tally.errors += 1
        tally.first_error = tally.first_error or f"HTTP {status} opening a session: {opened}"
        return None
    session = f"{service}/sessions/{opened['session_id']}"
    agent = None if transport is None else openai.AsyncOpenAI(base_url=f"{session}/v1", api_key=CONTROL_TOKEN,
                                                              http_client=transport, max_retries=0)

    def turn_of(messages: list) -> Any:
        if agent is None:
            return post(http, f"{session}/v1/chat/completions",
                        {"model": "policy", "messages": messages, "max_tokens": MAX_NEW_TOKENS})
        return openai_turn(agent, messages)
    messages: list = [{"role": "user", "content": f"Question {index}: what is {index} + 1?"}]
    for turn in range(turns):
        completion = await tally.timed(lambda: turn_of(messages))
        if completion is None:
            break
        reply = completion["choices"][0]["message"] if agent is None else completion.choices[0].message
        messages += [reply, {"role": "user", "content": f"And then, step {turn + 2}?"}]
    async with http.delete(session) as closed:
        return (await closed.json())["samples"]


async def load(urls: dict, processes: list[subprocess.Popen], args: argparse.Namespace, stop_id: int) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with client(args.timeout_s + 10) as http, \
            httpx.AsyncClient(limits=limits, timeout=args.timeout_s + 10) as transport:
        for engine in urls["engines"]:  # the first forward of each engine pays torch's warm-up: not measured
            await post(http, engine + "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        pids = {"sessions": [processes[-1].pid], "router": [processes[-2].pid],
                "engines": [p.pid for p in processes[:-2]]}
        cpu_before = {name: sum(map(cpu_s, group)) for name, group in pids.items()}
        via, started, client_cpu = Tally(), time.monotonic(), time.process_time()
        closed = await asyncio.gather(*(one_episode(http, transport, urls["sessions"], i, args.turns, via)
                                        for i in range(args.sessions)))
        via_wall = time.monotonic() - started
        cpu = {"client": round(time.process_time() - client_cpu, 1),
               **{name: round(sum(map(cpu_s, group)) - cpu_before[name], 1) for name, group in pids.items()}}
        raw, started, client_cpu = Tally(), time.monotonic(), time.process_time()
        raw_closed = await asyncio.gather(*(one_episode(http, None, urls["sessions"], i, args.turns, raw)
                                            for i in range(args.sessions)))
        raw_wall, raw_client_cpu = time.monotonic() - started, round(time.process_time() - client_cpu, 1)
        straight, started = Tally(), time.monotonic()
        engines = urls["engines"]
        await asyncio.gather(*(straight_session(http, engines[i % len(engines)], turn_inputs(samples[0]), stop_id,
                                                straight) for i, samples in enumerate(closed) if samples))
        straight_wall = time.monotonic() - started
    broken = sum(len(samples) != 1 for samples in [*closed, *raw_closed] if samples)
    return {"via": {**via.figures(via_wall), "cpu_s": cpu}, "straight": straight.figures(straight_wall),
            "raw": {**raw.figures(raw_wall), "client_cpu_s": raw_client_cpu}, "tito_broken": broken}


def main() -> None:
    args = fleet_args(__doc__, "--episodes", 1000, 2, 600.0)
    result = on_fleet(args, lambda urls, processes, stop_id: load(urls, processes, args, stop_id))
    via, straight = result["via"], result["straight"]
    print(json.dumps({
        "episodes": args.sessions, "turns": args.turns, "engines": args.engines, **via, "baseline": straight,
        "ratio_wall": round(via["wall_s"] / straight["wall_s"], 2),
        "ratio_p50": round(via["p50_ms"] / straight["p50_ms"], 2),
        "ratio_p99": round(via["p99_ms"] / straight["p99_ms"], 2),
        "endpoint_with_aiohttp": result["raw"],
        "ratio_wall_aiohttp": round(result["raw"]["wall_s"] / straight["wall_s"], 2),
        "ratio_p99_aiohttp": round(result["raw"]["p99_ms"] / straight["p99_ms"], 2),
        "tito_broken": result["tito_broken"],
    }))


if __name__ == "__main__":
    main()
