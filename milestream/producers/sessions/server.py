"""The token-in-token-out session service over HTTP (aiohttp), in front of any generation backend.

    POST   /sessions                {"match"?}                              -> {"session_id", "template", "match"}
    POST   /sessions/{id}/chat      {"messages", "tools"?, "sampling"?}     -> {"message", "finish_reason", ...}
    GET    /sessions/{id}/samples                                           -> {"samples": [SessionSample, ...]}
    DELETE /sessions/{id}                                                   -> {"samples": [...]} (the last look)

A chat turn sends the session's exact prompt ids to the backend with the session id as the routing
key (a cache-affine router keeps every turn of a session on one engine) and stops at the
template's end-of-turn token. Bad requests get a 400 naming the field (``messages[3].role``); a turn
the backend fails (an engine down behind the router) gets a 502 with the backend's error, and the
session stays as it was before the turn. Closing a session tells a routing backend (one with
``end_session``, as ``RouterClient``) to forget its key.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from aiohttp import web

from milestream.config import Config, RolloutConfig, import_path
from milestream.engines.engine import Engine, GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.http_api import serve_app
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
                 match: MatchLevel = "strict", max_sessions: int = 1024) -> None:
        self.template = template
        self.backend = backend
        self.rollout = rollout
        self.match = match
        self.max_sessions = max_sessions
        self.sessions: dict[str, TokenSession] = {}

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_as_json])
        app.add_routes([
            web.post("/sessions", self.create),
            web.post("/sessions/{session_id}/chat", self.chat),
            web.get("/sessions/{session_id}/samples", self.samples),
            web.delete("/sessions/{session_id}", self.close),
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
        return web.json_response({"session_id": session_id, "template": self.template.name, "match": match},
                                 status=201)

    async def chat(self, request: web.Request) -> web.Response:
        session_id, session = self._session(request)
        body = await _json_body(request)
        turn = session.begin(body.get("messages"), body.get("tools"))
        sampling = self._sampling(body.get("sampling", {}))
        try:
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

    async def samples(self, request: web.Request) -> web.Response:
        _, session = self._session(request)
        return web.json_response({"samples": [dataclasses.asdict(s) for s in session.samples()]})

    async def close(self, request: web.Request) -> web.Response:
        session_id, session = self._session(request)
        del self.sessions[session_id]
        end_session = getattr(self.backend, "end_session", None)
        if end_session is not None:  # a router behind the backend forgets the key, so its table stays small
            try:
                await end_session(session_id)
            except Exception as exc:  # noqa: BLE001 - the samples matter more; the router's LRU drops the key in time
                log.warning("session %s closed, but the backend did not release its key: %s", session_id, exc)
        return web.json_response({"samples": [dataclasses.asdict(s) for s in session.samples()]})

    def _session(self, request: web.Request) -> tuple[str, TokenSession]:
        session_id = request.match_info["session_id"]
        if session_id not in self.sessions:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no open session {session_id!r}"}),
                                   content_type="application/json")
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


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except (RequestError, TemplateError) as exc:
        return web.json_response({"error": str(exc)}, status=400)


def build_service(cfg: Config) -> SessionService:
    """The service as configured: ``sessions.tokenizer`` (default: the policy's), ``sessions.backend``."""
    if cfg.sessions.tokenizer:
        tokenizer = import_path(cfg.sessions.tokenizer, "sessions.tokenizer")()
    else:
        from milestream.infra.model import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
    backend = import_path(cfg.sessions.backend, "sessions.backend")(cfg)
    return SessionService(chat_template(tokenizer), backend, cfg.rollout,
                          match=cfg.sessions.match, max_sessions=cfg.sessions.max_sessions)


def serve_sessions(cfg: Config) -> None:
    """``milestream sessions``: serve until SIGINT / SIGTERM; prints ``sessions serving http://HOST:PORT``
    once ready (port 0: a free one)."""
    service = build_service(cfg)
    log.info("session service: template %s, match %s", service.template.name, service.match)
    close = getattr(service.backend, "close", None)
    asyncio.run(serve_app(service.app(), cfg.sessions.host, cfg.sessions.port, name="sessions", on_stop=close))
