"""A stage's HTTP client never reuses a connection its server may be closing.

uvicorn (vLLM's and SGLang's server) closes a keep-alive connection after 5 idle seconds; aiohttp kept idle
connections for 15 s, so a weight update sent to vLLM ~5 s after the last one could go out on a closing connection
and fail ("Cannot write to closing transport"), which stopped a rollout worker in a 60-step vLLM run. The client
now drops a connection idle for ``CLIENT_KEEPALIVE_S``: a request after a longer idle spell opens a new one, which
this test sees as a new client port at the server (an aiohttp server with a long keep-alive, so only the
client's rule decides)."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer

from milestream.engines.http_api import CLIENT_KEEPALIVE_S
from milestream.engines.http_engine import HttpEngine

UVICORN_KEEPALIVE_S = 5.0


def test_a_connection_idle_longer_than_the_clients_keepalive_is_not_reused() -> None:
    assert CLIENT_KEEPALIVE_S < UVICORN_KEEPALIVE_S
    client_ports = asyncio.run(three_pauses())
    assert client_ports[0] == client_ports[1]
    assert client_ports[2] != client_ports[1]


async def three_pauses() -> list[int]:
    """The client port of each of three pauses: two at once, one after an idle spell."""
    client_ports: list[int] = []

    async def pause(request: web.Request) -> web.Response:
        client_ports.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/pause_generation", pause)
    server = TestServer(app, keepalive_timeout=3600.0)
    await server.start_server()
    engine = HttpEngine(str(server.make_url("")), timeout_s=10.0)
    try:
        await engine.pause()
        await engine.pause()  # at once: the same connection
        await asyncio.sleep(CLIENT_KEEPALIVE_S + 0.5)
        await engine.pause()  # after an idle spell longer than the client keeps a connection: a new one
    finally:
        await engine.close()
        await server.close()
    return client_ports
