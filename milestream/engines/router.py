"""The affinity router: every request of a session reaches the same engine (and data-parallel rank).

Each request carries its session's routing key in the ``X-SMG-Routing-Key`` header (the header
sglang-router's ``manual`` policy reads). A key seen before goes where it went before, so the engine
still holds that session's KV cache; a new key goes to the live engine with the fewest requests in
flight through this router (ties: the one with fewer sessions bound, then the lower index), and within
it to the least busy live rank. A request without a key is refused with HTTP 400 naming the header, never
sent somewhere at random. The table is bounded (``router.max_sessions``, least recently used key
evicted) and ``POST /end_session`` releases a finished session's key.

Engines speak SGLang's HTTP API (the CPU engine server or SGLang itself), so the router forwards
/generate bodies untouched; /pause_generation, /continue_generation and /update_weights_from_disk go
to every live rank of every engine.

When an engine dies. An upstream (one rank's URL) goes *down* when a request or a health probe to it
is refused, loses its connection, or gets no reply within ``router.request_timeout_s``, or when its
GET /health answers other than 200. Then:

- the request that met it is answered 502, and so is every other one in flight to it (their
  connections break with it, or they time out): none waits past ``request_timeout_s``. Every error
  the router answers itself names the engine index, rank, URL, the session key and the cause, in the
  ``message`` and as fields (``routing_key``, ``engine``, ``rank``, ``url``);
- no new session goes to it (with every upstream down, a new key is answered 503);
- a session bound to it before it went down is refused, not re-routed: its next request is answered
  503 naming the key, the engine and the cause, and the key is released, so the caller learns that the
  engine holding the session's cache is gone and decides itself whether to start over; its next
  request with that key (or any new key) starts a new session on a live engine;
- every ``router.health_interval_s`` each upstream gets GET /health; a down one that answers 200
  rejoins: it is first sent the fleet's newest successful weight update again (and paused, if the fleet
  is paused), then new sessions reach it. If that fails it stays down with that cause, so an engine
  restarted with old weights never serves before it has caught up;
- broadcasts skip down upstreams and list them in the reply (``skipped``, each with its cause). A
  broadcast succeeds when every live upstream answered 200 (at least one did); an upstream whose
  connection fails during it goes down (and catches up when it rejoins); one that answers an error is
  live and behind, so the broadcast fails with its message: a weight update never silently leaves a
  live engine on an older version.

GET /get_server_info shows each upstream's state (up / down), how often it went down, the requests
that failed because of it, and the cause of its last failure.

The broadcasts and /end_session are control routes: they need the run's control token (``Authorization:
Bearer TOKEN``, else 401), which the router sends on to the engines with each broadcast and catch-up, so only
an update a token holder sent is ever replayed; Host, Origin and JSON bodies are checked as the engine
server checks them (http_api.Guard).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import web

from milestream.config import Config, ConfigError, RouterConfig
from milestream.engines.http_api import (JSON, ROUTING_KEY_HEADER, BadRequest, Guard, authorization, client_session,
                                           bad_request_as_400, error_response, reply_message, serve_app,
                                           transport_failure)

log = logging.getLogger(__name__)
UPSTREAM_HEADER = "X-Milestream-Upstream"  # on each /generate reply: engine index, rank and URL that served it
BROADCAST_PATHS = ("/pause_generation", "/continue_generation", "/update_weights_from_disk")
CONTROL_ROUTES = frozenset({*BROADCAST_PATHS, "/end_session"})


@dataclass(frozen=True)
class Upstream:
    engine: int
    rank: int
    url: str

    def __str__(self) -> str:
        return f"engine {self.engine} rank {self.rank} {self.url}"

    def fields(self) -> dict[str, Any]:
        return {"engine": self.engine, "rank": self.rank, "url": self.url}


@dataclass
class Health:
    """One upstream's standing. ``epoch`` counts its downs: a session bound in an older epoch lost its cache."""

    up: bool = True
    epoch: int = 0
    failures: int = 0  # requests answered with an error because of it: in flight, or their session was lost
    cause: str = ""  # of its last failure
    since: float = field(default_factory=time.time)  # when it last went up or down


class Unroutable(Exception):
    """A request the router answers itself with 503: its session's engine went down, or none is up."""

    def __init__(self, message: str, key: str, upstream: Upstream | None = None) -> None:
        super().__init__(message)
        self.key, self.upstream = key, upstream

    def response(self) -> web.Response:
        fields = self.upstream.fields() if self.upstream is not None else {}
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(self), routing_key=self.key, **fields)


class AffinityTable:
    """Routing key -> upstream, bounded LRU; the in-flight count and the health of every upstream."""

    def __init__(self, engines: Sequence[Sequence[str]], max_sessions: int) -> None:
        if not engines or not all(engines):
            raise ConfigError(f"router.engines needs at least one engine with at least one URL, got {engines!r}")
        if max_sessions < 1:
            raise ValueError(f"router.max_sessions must be at least 1, got {max_sessions}")
        self.engines = [[Upstream(e, r, url.rstrip("/")) for r, url in enumerate(urls)]
                        for e, urls in enumerate(engines)]
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, tuple[Upstream, int]] = OrderedDict()  # key -> (upstream, its epoch then)
        self.active: Counter[Upstream] = Counter()
        self.bound: Counter[Upstream] = Counter()  # live sessions per upstream
        self.health = {upstream: Health() for upstream in self.upstreams}
        self.evicted = 0

    @property
    def upstreams(self) -> list[Upstream]:
        return [upstream for ranks in self.engines for upstream in ranks]

    def route(self, key: str) -> Upstream:
        """The key's upstream; a new key is bound to the least loaded live one. Raises ``Unroutable``
        (and releases the key) when the key's upstream went down since, or when none is up."""
        bound = self.sessions.get(key)
        if bound is not None:
            upstream, epoch = bound
            health = self.health[upstream]
            if epoch == health.epoch:
                self.sessions.move_to_end(key)
                return upstream
            self.release(key)
            health.failures += 1
            raise Unroutable(f"session {key!r} was on {upstream}, which went down since ({health.cause}): its "
                             "KV cache there is gone, so this request is refused rather than re-routed; the key "
                             "is released: start the session again and it goes to a live engine", key, upstream)
        upstream = self._least_loaded(key)
        self.sessions[key] = (upstream, self.health[upstream].epoch)
        self.bound[upstream] += 1
        if len(self.sessions) > self.max_sessions:
            self.release(next(iter(self.sessions)))
            self.evicted += 1
        return upstream

    def release(self, key: str) -> bool:
        bound = self.sessions.pop(key, None)
        if bound is None:
            return False
        upstream, epoch = bound
        if epoch == self.health[upstream].epoch:  # a lost session was already uncounted when its upstream went down
            self.bound[upstream] -= 1
        return True

    def mark_down(self, upstream: Upstream, cause: str) -> bool:
        """Record the failure; True if the upstream was up until now."""
        health = self.health[upstream]
        health.cause = cause
        if not health.up:
            return False
        health.up, health.since = False, time.time()
        health.epoch += 1  # its sessions are lost: each is refused, and released, on its next request
        self.bound[upstream] = 0
        return True

    def mark_up(self, upstream: Upstream) -> None:
        health = self.health[upstream]
        health.up, health.since = True, time.time()

    def _least_loaded(self, key: str) -> Upstream:
        live = [[u for u in ranks if self.health[u].up] for ranks in self.engines]
        candidates = [index for index, ranks in enumerate(live) if ranks]
        if not candidates:
            causes = "; ".join(f"{u}: {self.health[u].cause}" for u in self.upstreams)
            raise Unroutable(f"no live engine for session {key!r}: every upstream is down ({causes})", key)

        def engine_load(index: int) -> tuple[int, int, int]:
            ranks = live[index]
            return sum(self.active[u] for u in ranks), sum(self.bound[u] for u in ranks), index

        ranks = live[min(candidates, key=engine_load)]
        return min(ranks, key=lambda u: (self.active[u], self.bound[u], u.rank))


class Router:
    def __init__(self, cfg: RouterConfig, guard: Guard) -> None:
        self.cfg, self.guard = cfg, guard
        self.table = AffinityTable(cfg.engines, cfg.max_sessions)
        self._client: aiohttp.ClientSession | None = None
        self._watchers: list[asyncio.Task] = []
        # broadcasts and rejoins one at a time, so an upstream rejoining never misses an update sent meanwhile
        self._control = asyncio.Lock()
        self._catch_up: dict[str, bytes] = {}  # path -> body a rejoining upstream is sent first

    def app(self) -> web.Application:
        middlewares = [self.guard.middleware(lambda request: request.path in CONTROL_ROUTES), bad_request_as_400]
        app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/generate", self.generate), web.put("/generate", self.generate),
                        web.post("/end_session", self.end_session),
                        *(web.post(path, self.broadcast) for path in BROADCAST_PATHS),
                        web.get("/health", self.health), web.get("/get_server_info", self.server_info),
                        web.get("/get_model_info", self.model_info)])
        app.on_startup.append(self._watch_all)
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
            self._client = client_session(self.cfg.request_timeout_s)
        return self._client

    async def _watch_all(self, app: web.Application) -> None:
        self._watchers = [asyncio.create_task(self._watch(upstream)) for upstream in self.table.upstreams]

    async def _close(self, app: web.Application) -> None:
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    def _failed(self, upstream: Upstream, exc: BaseException) -> str:
        """Mark the upstream down for ``exc`` (no reply); the cause, in words."""
        cause = transport_failure(exc, self.cfg.request_timeout_s) + (
            " (router.request_timeout_s)" if isinstance(exc, asyncio.TimeoutError) else "")
        self._down(upstream, cause)
        return cause

    def _down(self, upstream: Upstream, cause: str) -> None:
        if self.table.mark_down(upstream, cause):
            log.warning("%s is down: %s", upstream, cause)

    async def generate(self, request: web.Request) -> web.Response:
        key = self._routing_key(request)
        body = await request.read()
        try:
            upstream = self.table.route(key)
        except Unroutable as exc:
            return exc.response()
        self.table.active[upstream] += 1
        try:
            async with self._session().post(upstream.url + "/generate", data=body, headers={
                    "Content-Type": JSON, self.cfg.key_header: key}) as reply:
                payload = await reply.read()
                return web.Response(body=payload, status=reply.status, content_type=reply.content_type,
                                    headers={UPSTREAM_HEADER: str(upstream)})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            cause = self._failed(upstream, exc)
            self.table.health[upstream].failures += 1
            return error_response(HTTPStatus.BAD_GATEWAY, f"{upstream} failed a request of session {key!r}: "
                                  f"{cause}; it is marked down (no new session goes there until its /health "
                                  "answers again) and the session's next request is refused, its KV cache "
                                  "being lost", routing_key=key, **upstream.fields())
        finally:
            self.table.active[upstream] -= 1

    async def end_session(self, request: web.Request) -> web.Response:
        key = self._routing_key(request)
        return web.json_response({"routing_key": key, "released": self.table.release(key)})

    async def broadcast(self, request: web.Request) -> web.Response:
        """The same control request to every live rank of every engine; 200 if all of them said 200."""
        body = await request.read()
        async with self._control:
            live = [u for u in self.table.upstreams if self.table.health[u].up]
            replies = await asyncio.gather(*(self._forward(u, request.path, body) for u in live))
            failed = [reply for reply in replies if reply["status"] != HTTPStatus.OK and not reply["went_down"]]
            done = [reply for reply in replies if reply["status"] == HTTPStatus.OK]
            if done and not failed:
                self._remember(request.path, body)
        skipped = [{"upstream": str(u), "cause": h.cause} for u, h in self.table.health.items() if not h.up]
        if failed:
            message = (f"{request.path} failed on {len(failed)} of {len(replies)} upstreams; "
                       + "; ".join(f"{reply['upstream']}: {reply['message']}" for reply in failed))
        else:
            message = f"{request.path} succeeded on {len(done)} of {len(self.table.health)} upstreams"
        if skipped:
            message += (f"; {len(skipped)} down, skipped ("
                        + "; ".join(f"{s['upstream']}: {s['cause']}" for s in skipped)
                        + "): each gets the newest weight update and pause state before it serves again")
        status = failed[0]["status"] if failed else HTTPStatus.OK if done else HTTPStatus.SERVICE_UNAVAILABLE
        return web.json_response({"success": status == HTTPStatus.OK, "message": message, "upstreams": replies,
                                  "skipped": skipped}, status=status)

    def _remember(self, path: str, body: bytes) -> None:
        if path == "/continue_generation":
            self._catch_up.pop("/pause_generation", None)
        else:
            self._catch_up[path] = body

    async def _forward(self, upstream: Upstream, path: str, body: bytes) -> dict[str, Any]:
        try:
            headers = {"Content-Type": JSON, **authorization(self.guard.token.value)}
            async with self._session().post(upstream.url + path, data=body, headers=headers) as reply:
                status, text = reply.status, await reply.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return {"upstream": str(upstream), "status": HTTPStatus.BAD_GATEWAY,
                    "message": self._failed(upstream, exc), "went_down": True}
        return {"upstream": str(upstream), "status": status, "message": reply_message(text), "went_down": False}

    async def _watch(self, upstream: Upstream) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                async with self._session().get(upstream.url + "/health") as reply:
                    if reply.status != HTTPStatus.OK:
                        self._down(upstream, f"GET /health answered HTTP {reply.status}")
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self._failed(upstream, exc)
                continue
            if not self.table.health[upstream].up:
                await self._rejoin(upstream)

    async def _rejoin(self, upstream: Upstream) -> None:
        """Send a recovered upstream what it missed while down, then let new sessions reach it."""
        async with self._control:
            for path, body in self._catch_up.items():
                reply = await self._forward(upstream, path, body)
                if reply["status"] != HTTPStatus.OK:
                    self.table.mark_down(upstream, f"answers /health, but rejoining, {path} failed: {reply['message']}")
                    return
            self.table.mark_up(upstream)
        log.info("%s is up again (sent first: %s)", upstream, ", ".join(self._catch_up) or "nothing")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=HTTPStatus.OK)

    async def model_info(self, request: web.Request) -> web.Response:
        live = [u for u in self.table.upstreams if self.table.health[u].up]
        if not live:
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, "no live engine: every upstream is down")
        async with self._session().get(live[0].url + "/get_model_info") as reply:
            return web.Response(body=await reply.read(), status=reply.status, content_type=reply.content_type)

    async def server_info(self, request: web.Request) -> web.Response:
        table = self.table

        def upstream_info(u: Upstream) -> dict[str, Any]:
            health = table.health[u]
            return {"url": u.url, "state": "up" if health.up else "down", "active_requests": table.active[u],
                    "sessions": table.bound[u], "downs": health.epoch, "failures": health.failures,
                    "cause": health.cause, "since": health.since}

        policy = "sticky routing key; new keys to the live engine with the fewest active requests"
        return web.json_response({"policy": policy,
                                  "key_header": self.cfg.key_header, "max_sessions": table.max_sessions,
                                  "sessions": len(table.sessions), "evicted": table.evicted,
                                  "down": sum(not h.up for h in table.health.values()),
                                  "catch_up": list(self._catch_up),
                                  "engines": [[upstream_info(u) for u in ranks] for ranks in table.engines]})


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


def serve_router(cfg: Config) -> None:
    """Serve ``cfg.router`` until SIGTERM; prints ``router serving http://HOST:PORT`` once ready."""
    router = Router(cfg.router, Guard.of(cfg, cfg.router.host, "router"))
    asyncio.run(serve_app(router.app(), cfg.router.host, cfg.router.port, name="router"))
