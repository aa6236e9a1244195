"""Who may drive an engine server and the router (issue 31): one engine process (tiny random model) started
with a run folder, the router in front of it. A control route without the run's token, a weight file outside
the run's weight folders, a body that is not JSON and a request from another site's page are each refused,
and none of them changes what the engine holds or what the router would replay to a rejoining engine."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch

from milestream.config import ModelConfig
from milestream.infra.model import load_model, trainable_state_dict
from milestream.streams.weights.base import engine_weights_dir
from milestream.streams.weights.disk import write_full
from milestream_testkit.servers import CONTROL_HEADERS, MODEL, get_json, post_json, ready_urls, start, stop

CONTROL_ROUTES = ("/pause_generation", "/continue_generation", "/update_weights_from_disk")


@dataclass(frozen=True)
class Served:
    run_dir: Path
    engine: str
    router: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    run_dir = tmp_path_factory.mktemp("control")
    engine = start(["engine", "--port", "0", "--engine-id", "c", "--run-dir", str(run_dir), *MODEL],
                   run_dir / "engine.log")
    try:
        url = ready_urls(engine, 1, run_dir / "engine.log")["engine c"]
        router = start(["router", "--set", f"router.engines=[{url}]", "--set", "router.port=0"], run_dir / "router.log")
        try:
            yield Served(run_dir, url, ready_urls(router, 1, run_dir / "router.log")["router"])
        finally:
            stop(router)
    finally:
        stop(engine)


@pytest.fixture(scope="module")
def version_one(served: Served) -> Path:
    """A valid whole-model version 1 outside the run folder, for the engine to refuse."""
    model = load_model(ModelConfig(name="tiny-random", dtype="float32", lora_rank=0), dtype=torch.float32)
    tensors = {name: tensor + 0.01 for name, tensor in trainable_state_dict(model).items()}
    path, _, _ = write_full(served.run_dir.parent / f"{served.run_dir.name}-elsewhere", 1, 1, tensors)
    return path


async def _post(http: aiohttp.ClientSession, url: str, **kwargs) -> tuple[int, str]:
    async with http.post(url, **kwargs) as reply:
        return reply.status, await reply.text()


async def _state(http: aiohttp.ClientSession, served: Served) -> tuple[str, bool, list[str]]:
    """The engine's version, whether it is paused, and what the router would replay to a rejoining engine."""
    info = await get_json(http, served.engine + "/get_server_info")
    replayed = (await get_json(http, served.router + "/get_server_info"))["catch_up"]
    return info["weight_version"], info["internal_states"][0]["paused"], replayed


def _leaves_state_unchanged(served: Served, probe: Callable[[aiohttp.ClientSession], Awaitable[None]]) -> None:
    """Run ``probe``'s requests; what the engine holds and what the router would replay is as before."""
    async def scenario() -> None:
        async with aiohttp.ClientSession() as http:
            before = await _state(http, served)
            await probe(http)
            assert await _state(http, served) == before

    asyncio.run(scenario())


def test_control_routes_refuse_a_caller_without_the_run_token(served: Served, version_one: Path) -> None:
    forged = {"model_path": str(version_one), "weight_version": "1"}

    async def probe(http: aiohttp.ClientSession) -> None:
        assert await _state(http, served) == ("0", False, [])
        for url in (served.engine, served.router):
            for path in CONTROL_ROUTES:
                for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": "forged"}):
                    status, text = await _post(http, url + path, json=forged, headers=headers)
                    assert status == 401 and "control token" in text, (url, path, headers, status, text)
        status, text = await _post(http, served.router + "/end_session", json={}, headers={"X-SMG-Routing-Key": "k"})
        assert status == 401, text

    _leaves_state_unchanged(served, probe)


def test_a_weight_file_outside_the_run_folders_is_refused_even_through_a_symlink(served: Served,
                                                                               version_one: Path) -> None:
    inside = engine_weights_dir(served.run_dir) / "linked"
    inside.mkdir(parents=True, exist_ok=True)
    (inside / version_one.name).unlink(missing_ok=True)
    (inside / version_one.name).symlink_to(version_one)

    async def probe(http: aiohttp.ClientSession) -> None:
        for model_path in (version_one, inside / version_one.name, inside / ".." / ".." / ".." / version_one.name):
            body = {"model_path": str(model_path), "weight_version": "1"}
            status, reply = await post_json(http, served.engine + "/update_weights_from_disk", body)
            assert status == 403 and "outside the run's weight folders" in reply["message"], (model_path, reply)
            status, reply = await post_json(http, served.router + "/update_weights_from_disk", body)
            assert status == 403 and reply["success"] is False, reply  # the engine's refusal, passed on

    _leaves_state_unchanged(served, probe)

    async def load_from_inside() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http:
            return await post_json(http, served.engine + "/update_weights_from_disk",
                                   {"model_path": str(copied), "weight_version": "1"})

    # the same file inside the run's folder is taken: the refusal was about where it lies
    copied = engine_weights_dir(served.run_dir) / "copied" / version_one.name
    copied.parent.mkdir(parents=True, exist_ok=True)
    copied.write_bytes(version_one.read_bytes())
    status, reply = asyncio.run(load_from_inside())
    assert status == 200 and reply["success"], reply


def test_a_body_that_is_not_json_is_refused_with_415(served: Served) -> None:
    async def probe(http: aiohttp.ClientSession) -> None:
        for url in (served.engine, served.router):
            for path in (*CONTROL_ROUTES, "/generate"):
                for content_type in ("text/plain", "application/x-www-form-urlencoded"):
                    status, text = await _post(http, url + path, data=b'{"mode": "in_place"}',
                                               headers={**CONTROL_HEADERS, "Content-Type": content_type,
                                                        "X-SMG-Routing-Key": "k"})
                    assert status == 415 and "application/json" in text, (url, path, content_type, text)

    _leaves_state_unchanged(served, probe)


def test_a_foreign_host_or_origin_is_refused_with_403(served: Served) -> None:
    async def probe(http: aiohttp.ClientSession) -> None:
        for url in (served.engine, served.router):
            port = url.rsplit(":", 1)[1]
            for headers in ({"Host": f"rebound.example:{port}"}, {"Origin": "http://evil.example"}, {"Origin": "null"}):
                for path in ("/pause_generation", "/get_server_info"):
                    method = http.post if path == "/pause_generation" else http.get
                    async with method(url + path, json={} if method == http.post else None,
                                      headers={**CONTROL_HEADERS, **headers}) as reply:
                        assert reply.status == 403, (url, path, headers, await reply.text())
            # the server's own names and a same-origin page are answered
            for headers in ({"Host": f"localhost:{port}"}, {"Origin": url}):
                async with http.get(url + "/get_server_info", headers=headers) as reply:
                    assert reply.status == 200, (url, headers, await reply.text())

    _leaves_state_unchanged(served, probe)
