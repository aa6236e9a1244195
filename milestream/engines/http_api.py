"""What the CPU engine server and the router share on the wire: SGLang's error body, JSON field checks
that name the offending field (and index), the middleware that turns a bad field into HTTP 400, and the
``Guard`` in front of every milestream server (engine, router, session service; the live page's checks).

Kept free of torch so the router process starts in a fraction of a second.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import resource
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from milestream.config import Config
from milestream.infra.lifecycle import async_stop
from milestream.infra.secret_env import ControlToken, control_token

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
JSON = "application/json"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})

# sglang-router's `manual` policy reads the same header, so one client serves both routers
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class BadRequest(ValueError):
    """A request field the server cannot accept; the message names the field (and index)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


def error_response(status: int, message: str, **fields: Any) -> web.Response:
    """SGLang's error body (``ErrorResponse``), so SGLang clients read our errors unchanged; ``fields``
    are added to it (the router names the engine and session a failure concerns)."""
    body = {"object": "error", "message": message, "type": HTTPStatus(status).phrase, "code": status, **fields}
    return web.json_response(body, status=status)


# Servers close a keep-alive connection idle for their timeout (uvicorn's default, which vLLM and SGLang use, is 5 s);
# a client that reuses it at that moment loses the request ("Cannot write to closing transport"). A client that
# drops idle connections sooner never reuses one the server is closing.
CLIENT_KEEPALIVE_S = 2.0


def client_session(timeout_s: float) -> aiohttp.ClientSession:
    """The aiohttp client a stage talks to engines with: no connection limit, idle connections dropped before any
    server drops them."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S)
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), connector=connector)


def transport_failure(exc: BaseException, timeout_s: float) -> str:
    """Why an HTTP exchange got no reply, in words: the peer refused, dropped the connection, or was silent."""
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's own timeouts are TimeoutErrors too
        return f"no reply within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"connection refused or unreachable ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection closed before the reply (the process died or dropped it)"
    if isinstance(exc, aiohttp.ClientOSError):
        return f"connection broken ({exc.strerror or exc})"
    return f"{type(exc).__name__}: {exc}"


def reply_message(text: str) -> str:
    """The ``message`` of an SGLang JSON reply (error or result), else the text itself."""
    try:
        return str(json.loads(text)["message"])
    except (ValueError, KeyError, TypeError):
        return text[:500]


def authorization(token: str) -> dict[str, str]:
    """The header a client of a control route sends."""
    return {hdrs.AUTHORIZATION: f"Bearer {token}"}


def host_name(host: str) -> str:
    """A Host header's name, lower case, without its port: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def browser_refusal(host: str | None, origin: str | None, bind_host: str) -> str | None:
    """Why a request with these Host and Origin headers is refused (None: it is not). A server bound to one
    address answers only its own names (that address, loopback names): a web page whose name was rebound to
    the server's address (DNS rebinding) carries its own name. An Origin, when sent, must be the server's own:
    a page of another site may send a request but not read the reply, and must not drive the server either."""
    bound = bind_host.strip("[]").lower()
    if host is not None and bound not in WILDCARD_HOSTS and host_name(host) not in LOOPBACK_NAMES | {bound}:
        return (f"Host {host!r} is not a name of this server (bound to {bind_host}; loopback names and that "
                "address are answered): a page whose name points here is refused")
    if origin is not None and origin.lower() != f"http://{(host or '').lower()}":
        return f"Origin {origin!r} is not this server's: a request from another site's page is refused"
    return None


@dataclass(frozen=True)
class Guard:
    """Checked before any handler. Every request: its Host and Origin (``browser_refusal``: 403) and, when
    it has a body, the body's type: JSON only (415), since a form or text/plain is what any web page may
    send without asking. A control route (``protects``) also needs ``Authorization: Bearer TOKEN`` with the
    run's control token (401); what only reads, or generates, does not."""

    token: ControlToken
    bind_host: str

    @classmethod
    def of(cls, cfg: Config, bind_host: str, name: str) -> "Guard":
        """The guard of server ``name`` bound to ``bind_host``; says where its callers find the token."""
        token = control_token(cfg)
        log.info("%s: control routes take the token in %s ('Authorization: Bearer TOKEN')", name, token.source)
        return cls(token, bind_host)

    def middleware(self, protects: Callable[[web.Request], bool],
                   answer: Callable[[int, str], web.Response] = error_response) -> Middleware:
        @web.middleware
        async def guarded(request: web.Request, handler: Handler) -> web.StreamResponse:
            refusal = browser_refusal(request.headers.get(hdrs.HOST), request.headers.get(hdrs.ORIGIN),
                                      self.bind_host)
            if refusal is not None:
                return answer(HTTPStatus.FORBIDDEN, refusal)
            if protects(request) and not self.authorized(request):
                refused = answer(HTTPStatus.UNAUTHORIZED, f"{request.method} {request.path} changes this server's "
                                 "state: it needs the run's control token as 'Authorization: Bearer TOKEN' "
                                 "(run.control_token, else RUN_DIR/control.token of the server's run folder)")
                refused.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
                return refused
            if request.body_exists and request.content_type != JSON:
                return answer(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"{request.method} {request.path}: a body of type "
                              f"{request.content_type!r}; only {JSON} is accepted")
            return await handler(request)
        return guarded

    def authorized(self, request: web.Request) -> bool:
        given = request.headers.get(hdrs.AUTHORIZATION, "").encode()
        return hmac.compare_digest(given, authorization(self.token.value)[hdrs.AUTHORIZATION].encode())


@web.middleware
async def bad_request_as_400(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(HTTPStatus.BAD_REQUEST, str(exc))


async def json_object(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; ``optional``: an empty body reads as ``{}``."""
    if optional and not await request.read():
        return {}
    try:
        body = await request.json()
    except ValueError as exc:
        raise BadRequest("request body", f"not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadRequest("request body", f"expected a JSON object, got {type(body).__name__}")
    return body


def int_field(value: Any, field: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(field, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise BadRequest(field, f"must be at least {minimum}, got {value}")
    return value


def int_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(field, f"expected a list of integers, got {type(value).__name__}")
    return [int_field(item, f"{field}[{index}]", minimum=0) for index, item in enumerate(value)]


def number_field(value: Any, field: str, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(field, f"expected a number, got {value!r}")
    if value < minimum:
        raise BadRequest(field, f"must be at least {minimum}, got {value}")
    return float(value)


def raise_open_files_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit. Every connection is a descriptor,
    and a server in front of a thousand sessions holds theirs and as many onward: at the usual soft
    limit of 1024 the session service refused most of a thousand sessions (EMFILE) on the same machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def serve_app(app: web.Application, host: str, port: int, *, name: str,
                    on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve ``app`` until SIGTERM or SIGINT. Prints ``<name> serving http://HOST:PORT`` once the port is
    bound (port 0 picks a free one), which is what a parent process waits for."""
    raise_open_files_limit()
    runner = web.AppRunner(app, access_log=None)  # a line per request costs more than the routing
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_port = runner.addresses[0][1]
    # one write: engines started together share their parent's pipe, and print() writes the line and its
    # newline separately when Python runs unbuffered (PYTHONUNBUFFERED), so their lines could interleave
    sys.stdout.write(f"{name} serving http://{host}:{bound_port}\n")
    sys.stdout.flush()
    await async_stop(threading.Event()).wait()
    await runner.cleanup()
    if on_stop is not None:
        await on_stop()
