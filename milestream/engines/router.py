"""The affinity router: every request of a session reaches the same engine (and data-parallel rank).

Each request carries its session's routing key in the ``X-SMG-Routing-Key`` header (the header
sglang-router's ``manual`` policy reads). A key seen before goes where it went before, so the engine
still holds that session's KV cache; a new key goes to the engine with the fewest requests in flight
through this router (ties: the one with fewer sessions bound, then the lower index), and within it to
the least busy rank. A request without a key is refused with HTTP 400 naming the header, never sent
somewhere at random. The table is bounded (``router.max_sessions``, least recently used key evicted)
and ``POST /end_session`` releases a finished session's key.

Engines speak SGLang's HTTP API (the CPU engine server or SGLang itself), so the router forwards
/generate bodies untouched; /pause_generation, /continue_generation and /update_weights_from_disk go
to every rank of every engine.
"""
from __future__ import annotations

import asyncio
import sys
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from milestream.config import RouterConfig
from milestream.engines.http_api import (ROUTING_KEY_HEADER, BadRequest, bad_request_as_400, error_response,
                                           reply_message, serve_app)

UPSTREAM_HEADER = "X-Milestream-Upstream"  # on each /generate reply: engine index, rank and URL that served it
BROADCAST_PATHS = ("/pause_generation", "/continue_generation", "/update_weights_from_disk")


@dataclass(frozen=True)
class Upstream:
    engine: int
    rank: int
    url: str

    def __str__(self) -> str:
        return f"engine {self.engine} rank {self.rank} {self.url}"


class AffinityTable:
    """Routing key -> upstream, bounded LRU; also the in-flight count of every upstream."""

    def __init__(self, engines: Sequence[Sequence[str]], max_sessions: int) -> None:
        if not engines or not all(engines):
            raise ValueError(f"router.engines needs at least one engine with at least one URL, got {engines!r}")
        if max_sessions < 1:
            raise ValueError(f"router.max_sessions must be at least 1, got {max_sessions}")
        self.engines = [[Upstream(e, r, url.rstrip("/")) for r, url in enumerate(urls)]
                        for e, urls in enumerate(engines)]
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, Upstream] = OrderedDict()
        self.active: Counter[Upstream] = Counter()
        self.bound: Counter[Upstream] = Counter()  # sessions per upstream
        self.evicted = 0

    @property
    def upstreams(self) -> list[Upstream]:
        return [upstream for ranks in self.engines for upstream in ranks]

    def route(self, key: str) -> Upstream:
        upstream = self.sessions.get(key)
        if upstream is not None:
            self.sessions.move_to_end(key)
            return upstream
        upstream = self._least_loaded()
        self.sessions[key] = upstream
        self.bound[upstream] += 1
        if len(self.sessions) > self.max_sessions:
            _, oldest = self.sessions.popitem(last=False)
            self.bound[oldest] -= 1
            self.evicted += 1
        return upstream

    def release(self, key: str) -> bool:
        upstream = self.sessions.pop(key, None)
        if upstream is None:
            return False
        self.bound[upstream] -= 1
        return True

    def _least_loaded(self) -> Upstream:
        def engine_load(index: int) -> tuple[int, int, int]:
            ranks = self.engines[index]
            return sum(self.active[u] for u in ranks), sum(self.bound[u] for u in ranks), index

        ranks = self.engines[min(range(len(self.engines)), key=engine_load)]
        return min(ranks, key=lambda u: (self.active[u], self.bound[u], u.rank))


class Router:
    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.table = AffinityTable(cfg.engines, cfg.max_sessions)
        self._client: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bad_request_as_400], client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/generate", self.generate), web.put("/generate", self.generate),
                        web.post("/end_session", self.end_session),
                        *(web.post(path, self.broadcast) for path in BROADCAST_PATHS),
                        web.get("/health", self.health), web.get("/get_server_info", self.server_info),
                        web.get("/get_model_info", self.model_info)])
        app.on_cleanup.append(self._close)
        return app

    def _routing_key(self, request: web.Request) -> str:
        key = request.headers.get(self.cfg.key_header, "").strip()
        if not key:
            raise BadRequest(self.cfg.key_header, "missing header: every request carries its session's routing key "
                                                  "(the router never picks an engine for a request without one)")
        return key

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:  # created on the serving loop
            timeout = aiohttp.ClientTimeout(total=self.cfg.request_timeout_s)
            self._client = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self._client

    async def _close(self, app: web.Application) -> None:
        if self._client is not None:
            await self._client.close()

    async def generate(self, request: web.Request) -> web.Response:
        key = self._routing_key(request)
        body = await request.read()
        upstream = self.table.route(key)
        self.table.active[upstream] += 1
        try:
            async with self._session().post(upstream.url + "/generate", data=body, headers={
                    "Content-Type": "application/json", self.cfg.key_header: key}) as reply:
                payload = await reply.read()
                return web.Response(body=payload, status=reply.status, content_type=reply.content_type,
                                    headers={UPSTREAM_HEADER: str(upstream)})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return error_response(HTTPStatus.BAD_GATEWAY, f"{upstream}: {type(exc).__name__}: {exc}")
        finally:
            self.table.active[upstream] -= 1

    async def end_session(self, request: web.Request) -> web.Response:
        key = self._routing_key(request)
        return web.json_response({"routing_key": key, "released": self.table.release(key)})

    async def broadcast(self, request: web.Request) -> web.Response:
        """The same control request to every rank of every engine; 200 only if all of them said 200."""
        body = await request.read()
        replies = await asyncio.gather(*(self._forward(u, request.path, body) for u in self.table.upstreams))
        failed = [reply for reply in replies if reply["status"] != HTTPStatus.OK]
        message = (f"{request.path} succeeded on {len(replies)} upstreams" if not failed else
                   f"{request.path} failed on {len(failed)} of {len(replies)} upstreams; "
                   + "; ".join(f"{reply['upstream']}: {reply['message']}" for reply in failed))
        status = HTTPStatus.OK if not failed else failed[0]["status"]
        return web.json_response({"success": not failed, "message": message, "upstreams": replies}, status=status)

    async def _forward(self, upstream: Upstream, path: str, body: bytes) -> dict[str, Any]:
        try:
            async with self._session().post(upstream.url + path, data=body,
                                            headers={"Content-Type": "application/json"}) as reply:
                status, text = reply.status, await reply.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            status, text = HTTPStatus.BAD_GATEWAY, f"{type(exc).__name__}: {exc}"
        return {"upstream": str(upstream), "status": status, "message": reply_message(text)}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=HTTPStatus.OK)

    async def model_info(self, request: web.Request) -> web.Response:
        first = self.table.engines[0][0]
        async with self._session().get(first.url + "/get_model_info") as reply:
            return web.Response(body=await reply.read(), status=reply.status, content_type=reply.content_type)

    async def server_info(self, request: web.Request) -> web.Response:
        table = self.table
        engines = [[{"url": u.url, "active_requests": table.active[u], "sessions": table.bound[u]} for u in ranks]
                   for ranks in table.engines]
        policy = "sticky routing key; new keys to the engine with the fewest active requests"
        return web.json_response({"policy": policy,
                                  "key_header": self.cfg.key_header, "max_sessions": table.max_sessions,
                                  "sessions": len(table.sessions), "evicted": table.evicted, "engines": engines})


def sglang_router_args(cfg: RouterConfig) -> list[str]:
    """The same routing on sglang-router 0.3.2 (the ``gpu`` extra), checked against three CPU engine
    servers: its ``manual`` policy keeps each X-SMG-Routing-Key on one worker and ``min_load`` sends a
    new key to the worker with the fewest requests in flight. Where it differs: a request without the
    header goes to a random worker (HTTP 200, no error); keys expire after ``--max-idle-secs`` rather
    than by count or /end_session; every rank URL is a worker of its own (no engine grouping); and
    /pause_generation, /continue_generation and /update_weights_from_disk are not forwarded (HTTP 404:
    send them to each engine)."""
    if cfg.key_header.lower() != ROUTING_KEY_HEADER.lower():
        raise ValueError(f"router.key_header {cfg.key_header!r}: sglang-router reads {ROUTING_KEY_HEADER} only")
    urls = [url for ranks in cfg.engines for url in ranks]
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", cfg.host, "--port", str(cfg.port),
            "--worker-urls", *urls, "--policy", "manual", "--assignment-mode", "min_load",
            "--request-timeout-secs", str(int(cfg.request_timeout_s))]


def serve_router(cfg: RouterConfig) -> None:
    """Serve until SIGTERM; prints ``router serving http://HOST:PORT`` once ready."""
    asyncio.run(serve_app(Router(cfg).app(), cfg.host, cfg.port, name="router"))
