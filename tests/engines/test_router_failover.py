"""An engine that dies, or stops answering, behind the affinity router: three engine processes, each
started alone so one can be killed alone, and the router in front of them.

States are reached by construction: a request is in flight at an engine once that engine, paused
through its own URL, and the router both count it; the router's own /get_server_info says when an
engine is down or up again. Waits are on those conditions, with generous hang guards.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from milestream.config import ModelConfig, RolloutConfig
from milestream.engines.engine import SamplingParams
from milestream.engines.http_api import Guard
from milestream.engines.http_engine import EngineHttpError, HttpEngine, RouterClient
from milestream.infra.model import load_model, load_tokenizer, trainable_state_dict
from milestream.infra.secret_env import ControlToken
from milestream.producers.sessions.server import SessionService
from milestream.producers.sessions.templates import chat_template
from milestream.streams.weights.base import engine_weights_dir
from milestream_testkit.servers import (CONTROL_HEADERS, CONTROL_TOKEN, MODEL, get_json, post_json, ready_urls, start,
                                        stop)

REQUEST_TIMEOUT_S = 10.0  # a 4-token turn of the tiny model takes milliseconds; a silent engine costs this
HANG_GUARD_S = 120.0
SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0)


@dataclass
class Fleet:
    logs: Path
    urls: list[str]  # engine i is "e-i", on a fixed port so it can come back where it was
    processes: list[subprocess.Popen]
    router: str = ""
    opened: list[str] = field(default_factory=list)  # every routing key used, so each test takes new ones

    def start_engine(self, index: int, port: int = 0) -> subprocess.Popen:
        return start(["engine", "--port", str(port), "--engine-id", f"e-{index}", "--run-dir", str(self.logs), *MODEL],
                     self.logs / f"e-{index}.log")

    def restart(self, index: int) -> None:
        self.processes[index] = self.start_engine(index, port=int(self.urls[index].rsplit(":", 1)[1]))
        ready_urls(self.processes[index], 1, self.logs / f"e-{index}.log")

    def new_key(self) -> str:
        self.opened.append(f"s{len(self.opened)}")
        return self.opened[-1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("failover")
    fleet = Fleet(logs, [], [])
    try:
        fleet.processes = [fleet.start_engine(i) for i in range(3)]
        fleet.urls = [ready_urls(p, 1, logs / f"e-{i}.log")[f"engine e-{i}"] for i, p in enumerate(fleet.processes)]
        router = start(["router", "--set", f"router.engines=[{', '.join(fleet.urls)}]", "--set", "router.port=0",
                        "--set", f"router.request_timeout_s={REQUEST_TIMEOUT_S}",
                        "--set", "router.health_interval_s=0.2"], logs / "router.log")
        try:
            fleet.router = ready_urls(router, 1, logs / "router.log")["router"]
            yield fleet
        finally:
            stop(router)
    finally:
        for process in fleet.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)  # a test that failed while an engine was stopped
            stop(process)


async def _turn(http: aiohttp.ClientSession, fleet: Fleet, key: str) -> tuple[int, dict]:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    return await post_json(http, fleet.router + "/generate", body, key)


async def _served_by(http: aiohttp.ClientSession, fleet: Fleet, key: str) -> str:
    status, reply = await _turn(http, fleet, key)
    assert status == 200, reply
    return reply["meta_info"]["engine_id"]


async def _upstreams(http: aiohttp.ClientSession, fleet: Fleet) -> list[dict]:
    return [ranks[0] for ranks in (await get_json(http, fleet.router + "/get_server_info"))["engines"]]


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not await check():
        assert time.monotonic() < deadline, f"hang guard: {what} not reached in {HANG_GUARD_S:.0f} s"
        await asyncio.sleep(0.05)


async def _state_is(http: aiohttp.ClientSession, fleet: Fleet, index: int, state: str) -> None:
    async def reached() -> bool:
        return (await _upstreams(http, fleet))[index]["state"] == state
    await _until(reached, f"engine {index} {state}")


async def _sessions_on_every_engine(http: aiohttp.ClientSession, fleet: Fleet, per_engine: int) -> dict[str, list[str]]:
    """New sessions, one first turn each, until every engine holds ``per_engine`` of them: {engine id: keys}."""
    keys: dict[str, list[str]] = {f"e-{i}": [] for i in range(3)}
    while any(len(on) < per_engine for on in keys.values()):
        assert len(fleet.opened) < 100, f"new sessions never spread over the engines: {keys}"
        key = fleet.new_key()
        keys[await _served_by(http, fleet, key)].append(key)
    return keys


async def _sessions_on_a_fleet_all_up(http: aiohttp.ClientSession, fleet: Fleet, per_engine: int) -> dict:
    """Once the router reports every engine up: ``per_engine`` sessions opened on each."""
    for index in range(len(fleet.urls)):
        await _state_is(http, fleet, index, "up")
    return await _sessions_on_every_engine(http, fleet, per_engine=per_engine)

def test_a_killed_engine_fails_its_requests_fast_loses_its_sessions_and_rejoins_caught_up(fleet: Fleet) -> None:
    model = load_model(ModelConfig(name="tiny-random", dtype="float32", lora_rank=0), dtype=torch.float32)
    tensors = {name: tensor + 0.01 for name, tensor in trainable_state_dict(model).items()}
    victim = fleet.urls[1]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            keys = await _sessions_on_a_fleet_all_up(http, fleet, per_engine=2)
            in_flight, pinned = keys["e-1"]

            # a turn of e-1's session held at e-1 (paused through its own URL), then e-1 is killed
            assert (await post_json(http, victim + "/pause_generation", {}))[0] == 200
            held = asyncio.create_task(_turn(http, fleet, in_flight))

            async def held_at_e1() -> bool:
                at_engine = (await get_json(http, victim + "/get_server_info"))["internal_states"][0]
                return at_engine["active_requests"] == 1 and (await _upstreams(http, fleet))[1]["active_requests"] == 1
            await _until(held_at_e1, "the turn in flight at e-1")
            killed_at = time.monotonic()
            fleet.processes[1].kill()
            status, reply = await held
            assert time.monotonic() - killed_at < REQUEST_TIMEOUT_S  # the broken connection, not the timeout
            assert status == 502 and (reply["engine"], reply["rank"], reply["url"]) == (1, 0, victim), reply
            assert reply["routing_key"] == in_flight
            assert reply["message"].startswith(f"engine 1 rank 0 {victim} failed a request of session "
                                               f"{in_flight!r}: ") and "marked down" in reply["message"]
            e1 = (await _upstreams(http, fleet))[1]
            assert (e1["state"], e1["downs"], e1["failures"], e1["sessions"]) == ("down", 1, 1, 0), e1

            # the other engines' sessions go on; new sessions never reach e-1
            for _ in range(2):
                for engine in ("e-0", "e-2"):
                    assert {await _served_by(http, fleet, key) for key in keys[engine]} == {engine}
            assert {await _served_by(http, fleet, fleet.new_key()) for _ in range(4)} <= {"e-0", "e-2"}

            # e-1's other session is refused once, naming its key and engine, through the worker-side client
            client = RouterClient(fleet.router)
            with pytest.raises(EngineHttpError, match=f"HTTP 503: session {pinned!r} was on engine 1 rank 0 "
                                                      f"{victim}, which went down since") as refused:
                await client.generate([1, 2, 3], SAMPLING, pinned)
            assert refused.value.status == 503 and "KV cache there is gone" in str(refused.value)
            again = await client.generate([1, 2, 3], SAMPLING, pinned)  # key released
            assert len(again.output_ids) == 4
            await client.close()

            # a weight update while e-1 is down: the live two take it, the reply names the one skipped
            staged = engine_weights_dir(fleet.logs) / "staged"
            engine = HttpEngine(fleet.router, weights_dir=staged, token=CONTROL_TOKEN)
            await engine.pause()
            await engine.update_weights(1, tensors)
            await engine.resume()
            await engine.close()
            status, reply = await post_json(http, fleet.router + "/continue_generation", {})
            assert status == 200 and [s["upstream"] for s in reply["skipped"]] == [f"engine 1 rank 0 {victim}"]
            assert "1 down, skipped" in reply["message"] and reply["skipped"][0]["cause"]

            # e-1 back on its port, with version 0: it rejoins only once it holds version 1
            await asyncio.to_thread(fleet.restart, 1)
            await _state_is(http, fleet, 1, "up")
            assert (await get_json(http, victim + "/get_weight_version"))["weight_version"] == "1"
            status, reply = await _turn(http, fleet, fleet.new_key())  # e-1 holds the fewest sessions now
            assert status == 200 and reply["meta_info"]["engine_id"] == "e-1"
            assert reply["meta_info"]["output_token_weight_versions"] == [1] * 4

    asyncio.run(scenario())


def test_an_engine_that_stops_answering_times_out_and_rejoins(fleet: Fleet) -> None:
    silent = fleet.processes[2]

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            keys = await _sessions_on_a_fleet_all_up(http, fleet, per_engine=1)
            downs_before = (await _upstreams(http, fleet))[2]["downs"]
            os.kill(silent.pid, signal.SIGSTOP)
            try:
                sent_at = time.monotonic()
                stalled = asyncio.create_task(_turn(http, fleet, keys["e-2"][0]))
                assert await _served_by(http, fleet, keys["e-0"][0]) == "e-0"  # the router is not held up
                status, reply = await stalled
                waited = time.monotonic() - sent_at
            finally:
                os.kill(silent.pid, signal.SIGCONT)
            assert status == 502 and reply["engine"] == 2, reply
            assert f"no reply within {REQUEST_TIMEOUT_S:g} s (router.request_timeout_s)" in reply["message"]
            assert REQUEST_TIMEOUT_S * 0.9 < waited < REQUEST_TIMEOUT_S + 5.0

            await _state_is(http, fleet, 2, "up")
            assert (await _upstreams(http, fleet))[2]["downs"] == downs_before + 1
            status, reply = await _turn(http, fleet, keys["e-2"][0])  # its session is refused, not re-routed
            assert status == 503 and reply["routing_key"] == keys["e-2"][0] and reply["engine"] == 2
            assert await _served_by(http, fleet, fleet.new_key()) == "e-2"  # new sessions reach it again

    asyncio.run(scenario())


def test_the_session_service_over_the_router_answers_a_lost_turn_with_502_and_releases_keys(fleet: Fleet) -> None:
    """``sessions.backend`` at the router: a turn whose engine died is a 502 in the agent's hands naming
    that engine, the session stays as it was (the same turn again goes to a live engine), and closing
    the session releases its routing key."""
    service = SessionService(chat_template(load_tokenizer(ModelConfig(name="tiny-random"))),
                             RouterClient(fleet.router, token=CONTROL_TOKEN), RolloutConfig())
    guard = Guard(ControlToken(CONTROL_TOKEN, "the test"), "127.0.0.1")

    async def scenario() -> None:
        async with aiohttp.ClientSession() as http, \
                TestClient(TestServer(service.app(guard)), headers=CONTROL_HEADERS) as agent:
            for index in range(3):
                await _state_is(http, fleet, index, "up")
            held_before = [u["sessions"] for u in await _upstreams(http, fleet)]
            session_id = (await (await agent.post("/sessions")).json())["session_id"]
            chat = {"messages": [{"role": "user", "content": "Hi"}], "sampling": {"max_new_tokens": 4}}
            first = await agent.post(f"/sessions/{session_id}/chat", json=chat)
            assert first.status == 200
            chat["messages"] += [(await first.json())["message"], {"role": "user", "content": "And then?"}]
            held = [u["sessions"] for u in await _upstreams(http, fleet)]
            (index,) = [i for i in range(3) if held[i] == held_before[i] + 1]

            fleet.processes[index].kill()
            await _state_is(http, fleet, index, "down")  # the probe is refused
            lost = await agent.post(f"/sessions/{session_id}/chat", json=chat)
            assert lost.status == 502
            assert f"HTTP 503: session {session_id!r} was on engine {index} rank 0 {fleet.urls[index]}" in (
                await lost.json())["error"]
            again = await agent.post(f"/sessions/{session_id}/chat", json=chat)
            assert again.status == 200, await again.text()
            (sample,) = (await (await agent.delete(f"/sessions/{session_id}")).json())["samples"]
            mask = [0, *sample["loss_mask"]]
            generated_turns = sum(1 for a, b in zip(mask, mask[1:]) if (a, b) == (0, 1))
            assert generated_turns == 2  # one history of two turns: the lost turn left no trace
            assert sum(u["sessions"] for u in await _upstreams(http, fleet)) == sum(held_before) - held_before[index]
            await service.backend.close()

            await asyncio.to_thread(fleet.restart, index)
            await _state_is(http, fleet, index, "up")

    asyncio.run(scenario())
