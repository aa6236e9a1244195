"""The session service's guard and idle expiry (issue 31): every route needs the run's control token, a body
that is not JSON and a request from another site's page are refused, and a session without a request for
sessions.idle_expiry_s is closed, its routing key released. Time is the service's clock, moved by the test."""
from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer
from transformers import PreTrainedTokenizerBase

from milestream.config import Config, RolloutConfig
from milestream.engines.engine import GenerateResult, SamplingParams
from milestream.engines.http_api import Guard, authorization
from milestream.infra.secret_env import ControlToken
from milestream.producers.sessions.server import SessionService
from milestream.producers.sessions.templates import chat_template

TOKEN = "session-test-token"
GUARD = Guard(ControlToken(TOKEN, "the test"), "127.0.0.1")


class RoutingBackend:
    """A backend that generates nothing and records the routing keys it is told to forget."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult:
        raise AssertionError("no turn is taken here")

    async def end_session(self, routing_key: str) -> bool:
        self.released.append(routing_key)
        return True


def test_every_session_route_needs_the_token_json_and_its_own_origin(tokenizer: PreTrainedTokenizerBase) -> None:
    service = SessionService(chat_template(tokenizer), RoutingBackend(), RolloutConfig())

    async def scenario() -> None:
        async with TestClient(TestServer(service.app(GUARD))) as client:
            opened = await client.post("/sessions", json={}, headers=authorization(TOKEN))
            assert opened.status == 201
            session = f"/sessions/{(await opened.json())['session_id']}"
            for method, path in (("POST", "/sessions"), ("POST", f"{session}/chat"), ("GET", f"{session}/samples"),
                                 ("DELETE", session)):
                for headers in ({}, authorization("not-the-token")):
                    refused = await client.request(method, path, json={}, headers=headers)
                    assert refused.status == 401 and "control token" in (await refused.json())["error"]
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            as_text = await client.post(f"{session}/chat", data=str(chat), headers={**authorization(TOKEN),
                                                                                     "Content-Type": "text/plain"})
            assert as_text.status == 415
            for foreign in ({"Origin": "http://evil.example"}, {"Host": "rebound.example"}):
                refused = await client.post("/sessions", json={}, headers={**authorization(TOKEN), **foreign})
                assert refused.status == 403, foreign
            assert len(service.sessions) == 1

    asyncio.run(scenario())


def test_an_idle_session_expires_and_its_key_is_released(tokenizer: PreTrainedTokenizerBase) -> None:
    now = [1000.0]
    backend = RoutingBackend()
    expiry = Config().sessions.idle_expiry_s
    service = SessionService(chat_template(tokenizer), backend, RolloutConfig(), idle_expiry_s=expiry,
                             clock=lambda: now[0])

    async def scenario() -> None:
        async with TestClient(TestServer(service.app(GUARD)), headers=authorization(TOKEN)) as client:
            async def open_session() -> str:
                return (await (await client.post("/sessions")).json())["session_id"]

            idle, used = await open_session(), await open_session()
            now[0] += expiry / 2
            assert (await client.get(f"/sessions/{used}/samples")).status == 200  # a request is a use
            now[0] += expiry / 2  # idle's last use was expiry_s ago; used's half of it
            gone = await client.get(f"/sessions/{idle}/samples")
            assert gone.status == 404 and "idle past sessions.idle_expiry_s" in (await gone.json())["error"]
            assert (await client.get(f"/sessions/{used}/samples")).status == 200
            assert backend.released == [idle] and set(service.sessions) == {used}

    asyncio.run(scenario())
