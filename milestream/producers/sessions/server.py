"""The token-in-token-out session service over HTTP (aiohttp), in front of any generation backend.

    POST   /sessions                {"match"?}                              -> {"session_id", "template", "match"}
    POST   /sessions/{id}/chat      {"messages", "tools"?, "sampling"?}     -> {"message", "finish_reason", ...}
    GET    /sessions/{id}/samples                                           -> {"samples": [SessionSample, ...]}
    DELETE /sessions/{id}                                                   -> {"samples": [...]} (the last look)
    POST   /sessions/{id}/v1/chat/completions, POST /sessions/{id}/v1/responses, GET /sessions/{id}/v1/models:
           OpenAI's API on the session (openai_api.py, responses_api.py):
           ``openai.OpenAI(base_url=".../sessions/{id}/v1", api_key=TOKEN)``

A chat turn sends the session's exact prompt ids to the backend with the session id as the routing
key (a cache-affine router keeps every turn of a session on one engine) and stops at the
template's end-of-turn token. Bad requests get a 400 naming the field (``messages[3].role``); a turn
the backend fails (an engine down behind the router) gets a 502 with the backend's error, and the
session stays as it was before the turn. Closing a session tells a routing backend (one with
``end_session``, as ``RouterClient``) to forget its key; so does closing a session that had no request for
``sessions.idle_expiry_s`` (a turn in flight counts as use until it ends), which any later request finds gone
(404).

Every route needs the run's control token (``Authorization: Bearer TOKEN``, else 401): each opens, extends,
reads or closes a session. A Host that is not the service's, another site's Origin (403) and a body that is
not JSON (415) are refused before any route (engines/http_api.py ``Guard``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from aiohttp import web

from milestream.config import Config, RolloutConfig, import_path
from milestream.engines.engine import Engine, GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.http_api import Guard, serve_app
from milestream.producers.sessions.openai_api import SamplingRules, chat_completion, models_reply
from milestream.producers.sessions.responses_api import responses
from milestream.producers.sessions.templates import ChatTemplate, TemplateError, chat_template
from milestream.producers.sessions.tito import MATCH_LEVELS, MatchLevel, TokenSession

log = logging.getLogger(__name__)
_SAMPLING_FIELDS = ("max_new_tokens", "temperature")


class GenerateBackend(Protocol):
    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult: ...


class EngineBackend:
    """One in-process engine (``CpuEngine``) as a backend; with one engine the key only names requests."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._numbers = itertools.count()

    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult:
        request = GenerateRequest(f"{routing_key}/{next(self._numbers)}", tuple(input_ids), sampling)
        return await self.engine.generate(request)


def cpu_engine_backend(cfg: Config) -> EngineBackend:
    """The default ``sessions.backend``: the built-in CPU engine on the configured policy."""
    from milestream.engines.engine import CpuEngine

    return EngineBackend(CpuEngine(cfg.model, cfg.rollout, seed=cfg.model.seed))


class RequestError(ValueError):
    """A client error: answered 400 with its message."""


class SessionService:
    def __init__(self, template: ChatTemplate, backend: GenerateBackend, rollout: RolloutConfig, *,
                 match: MatchLevel = "strict", max_sessions: int = 1024, idle_expiry_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic, model: str = "policy") -> None:
        self.template = template
        self.backend = backend
        self.rollout = rollout
        self.match = match
        self.max_sessions = max_sessions
        self.idle_expiry_s, self.clock = idle_expiry_s, clock
        self.model = model  # the name OpenAI's API answers with
        self.openai_rules = SamplingRules(rollout.max_new_tokens, rollout.temperature,
                                          topk_logprobs=rollout.logprobs_topk)
        self.sessions: dict[str, TokenSession] = {}
        # session id -> when it was last used (inf while a turn runs), least recently used first
        self._used: OrderedDict[str, float] = OrderedDict()

    def app(self, guard: Guard) -> web.Application:
        every_route = guard.middleware(lambda request: True, answer=_error)
        app = web.Application(middlewares=[every_route, self._closing_idle, _errors_as_json])
        app.add_routes([
            web.post("/sessions", self.create),
            web.post("/sessions/{session_id}/chat", self.chat),
            web.get("/sessions/{session_id}/samples", self.samples),
            web.delete("/sessions/{session_id}", self.close),
            web.post("/sessions/{session_id}/v1/chat/completions", self.chat_completions),
            web.post("/sessions/{session_id}/v1/responses", self.responses),
            web.get("/sessions/{session_id}/v1/models", self.models),
        ])
        return app

    async def create(self, request: web.Request) -> web.Response:
        body = await _json_body(request, optional=True)
        match = body.get("match", self.match)
        if match not in MATCH_LEVELS:
            raise RequestError(f"match: {match!r} is not one of {MATCH_LEVELS}")
        if len(self.sessions) >= self.max_sessions:
            raise web.HTTPTooManyRequests(text=json.dumps({"error": f"{self.max_sessions} sessions are open "
                                                           "(sessions.max_sessions): close some"}),
                                          content_type="application/json")
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = TokenSession(self.template, match)
        self._used[session_id] = self.clock()
        return web.json_response({"session_id": session_id, "template": self.template.name, "match": match},
                                 status=201)

    async def chat(self, request: web.Request) -> web.Response:
        session_id, session = self._session(request)
        body = await _json_body(request)
        turn = session.begin(body.get("messages"), body.get("tools"))
        sampling = self._sampling(body.get("sampling", {}))
        try:
            with self._turn_running(session_id):
                result = await self.backend.generate(list(turn.prompt_ids), sampling, session_id)
        except Exception as exc:  # noqa: BLE001 - the agent gets the backend's own words (which engine failed, why)
            return web.json_response({"error": f"session {session_id}: generation failed: {exc}"}, status=502)
        message = session.finish(turn, result.output_ids, result.logprobs, result.versions)
        return web.json_response({
            "message": message,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(turn.prompt_ids),
            "completion_tokens": len(result.output_ids),
            "weight_versions": sorted(set(result.versions)),
        })

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        session_id, session = self._session(request)
        with self._turn_running(session_id):
            generate = functools.partial(self.backend.generate, routing_key=session_id)
            return await chat_completion(request, session, generate, self.openai_rules, self.model)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        session_id, session = self._session(request)
        with self._turn_running(session_id):
            generate = functools.partial(self.backend.generate, routing_key=session_id)
            return await responses(request, session, generate, self.openai_rules, self.model)

    async def models(self, request: web.Request) -> web.Response:
        self._session(request)
        return models_reply(self.model)

    @contextlib.contextmanager
    def _turn_running(self, session_id: str) -> Iterator[None]:
        """A session is never idle while a turn of it runs."""
        self._used[session_id] = math.inf
        try:
            yield
        finally:
            if session_id in self._used:
                self._used[session_id] = self.clock()
                self._used.move_to_end(session_id)

    async def samples(self, request: web.Request) -> web.Response:
        _, session = self._session(request)
        return web.json_response({"samples": [dataclasses.asdict(s) for s in session.samples()]})

    async def close(self, request: web.Request) -> web.Response:
        session_id, session = self._session(request)
        await self._forget([session_id])
        return web.json_response({"samples": [dataclasses.asdict(s) for s in session.samples()]})

    async def _forget(self, session_ids: list[str]) -> None:
        """Drop the sessions; a routing backend (one with ``end_session``) forgets their keys, so its table
        stays small."""
        for session_id in session_ids:
            del self.sessions[session_id], self._used[session_id]
        end_session = getattr(self.backend, "end_session", None)
        if end_session is None:
            return
        released = await asyncio.gather(*map(end_session, session_ids), return_exceptions=True)
        for session_id, outcome in zip(session_ids, released):
            if isinstance(outcome, Exception):  # the samples matter more; the router's LRU drops the key in time
                log.warning("session %s closed, but the backend did not release its key: %s", session_id, outcome)

    @web.middleware
    async def _closing_idle(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Before each request, close the sessions idle for sessions.idle_expiry_s, least recently used first."""
        idle_since = self.clock() - self.idle_expiry_s
        idle = list(itertools.takewhile(lambda used: used[1] <= idle_since, self._used.items()))
        if idle:
            log.info("%d sessions closed: no request for %g s (sessions.idle_expiry_s)", len(idle), self.idle_expiry_s)
            await self._forget([session_id for session_id, _ in idle])
        return await handler(request)

    def _session(self, request: web.Request) -> tuple[str, TokenSession]:
        session_id = request.match_info["session_id"]
        if session_id not in self.sessions:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no open session {session_id!r} (closed, or idle "
                                                   "past sessions.idle_expiry_s)"}), content_type="application/json")
        self._used[session_id] = max(self._used[session_id], self.clock())  # a turn in flight stays inf
        self._used.move_to_end(session_id)
        return session_id, self.sessions[session_id]

    def _sampling(self, fields: Any) -> SamplingParams:
        if not isinstance(fields, Mapping) or set(fields) - set(_SAMPLING_FIELDS):
            raise RequestError(f"sampling: expected an object with only {_SAMPLING_FIELDS}, got {fields!r}")
        try:
            return SamplingParams(
                max_new_tokens=int(fields.get("max_new_tokens", self.rollout.max_new_tokens)),
                temperature=float(fields.get("temperature", self.rollout.temperature)),
                stop_token_ids=(self.template.end_of_turn_id,),
            )
        except (TypeError, ValueError) as exc:
            raise RequestError(f"sampling: {exc}") from None


async def _json_body(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    if optional and not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise RequestError(f"request body: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body: expected a JSON object, got {type(body).__name__}")
    return body


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except (RequestError, TemplateError) as exc:
        return _error(400, str(exc))


def build_service(cfg: Config) -> SessionService:
    """The service as configured: ``sessions.tokenizer`` (default: the policy's), ``sessions.backend``."""
    if cfg.sessions.tokenizer:
        tokenizer = import_path(cfg.sessions.tokenizer, "sessions.tokenizer")()
    else:
        from milestream.infra.model import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    backend = import_path(cfg.sessions.backend, "sessions.backend")(cfg)
    return SessionService(chat_template(tokenizer), backend, cfg.rollout, match=cfg.sessions.match,
                          max_sessions=cfg.sessions.max_sessions, idle_expiry_s=cfg.sessions.idle_expiry_s,
                          model=cfg.model.path or cfg.model.name)


def serve_sessions(cfg: Config) -> None:
    """``milestream sessions``: serve until SIGINT / SIGTERM; prints ``sessions serving http://HOST:PORT``
    once ready (port 0: a free one)."""
    service = build_service(cfg)
    log.info("session service: template %s, match %s", service.template.name, service.match)
    close = getattr(service.backend, "close", None)
    guard = Guard.of(cfg, cfg.sessions.host, "sessions")
    asyncio.run(serve_app(service.app(guard), cfg.sessions.host, cfg.sessions.port, name="sessions", on_stop=close))
