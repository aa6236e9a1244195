"""Agents written for the OpenAI SDK, trained unchanged: ``rollout.agent_fn`` of ``(base_url, api_key, prompt)``.

    rollout:
      generate_fn: milestream.producers.agents:openai_episode
      agent_fn: examples.openai_agent.agent:solve   # (base_url, api_key, prompt) -> the answer, sync or async

Each sample is one episode: a token-in-token-out session served as OpenAI's API at ``base_url``
(``http://127.0.0.1:PORT/episodes/ID/v1``: chat completions, sessions/openai_api.py, and responses,
sessions/responses_api.py) by the worker's episode server (on
loopback, one per worker process, up while an episode is open), with an api key of the episode's own, so
an agent reaches its own episode and no other. The agent gets that url, the key and the ``Prompt``
(``prompt.question``); a sync agent runs in a thread of its own, an async one on the worker's loop, and
either has ``rollout.agent_timeout_s`` to return. What it returns is the answer the reward scores: a
string, or None for the content of the sample's last assistant message; or ``{"answer": ..., "reward": ...}``
to report the episode's reward itself (a number, or a dict of named numbers as ``reward.fn`` may return;
the configured reward is then not asked, and a reward that is not a finite number is the sample's reward
error). The configured reward reads the episode's whole conversation as ``RewardSample.transcript``.
The sample is every
leaf of the session (rollout.episode_sample): the latest (the conversation the agent's last request continued,
what the reward reads) and the other branches and conversations, each the exact ids the engine saw and
generated, loss mask 1 over generated tokens only (a turn shared by several leaves in one of them). Sampling is the run's: a request may lower
``max_tokens`` but not raise it past ``rollout.max_new_tokens``, nor change the temperature (400).

An agent that raises, runs past its timeout or never calls the model fails its sample, and the worker
publishes the group as an error (its credit comes back, its prompt is done; ``rollout.max_errors``). A
timed-out episode is closed at once: the agent's next request gets a 404, so an agent looping on the
model ends; a sync agent stuck elsewhere keeps its thread until it returns (Python cannot stop one). A
turn that would pass ``rollout.max_context_tokens`` gets OpenAI's 400 ``context_length_exceeded``, and
the episode is trained as truncated (finish reason ``length``, no answer) whatever the agent does next.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import hdrs, web

from milestream.engines.engine import Engine, FinishReason, GenerateResult, SamplingParams
from milestream.engines.http_api import Guard, authorization
from milestream.infra.secret_env import ControlToken
from milestream.producers.rewards import Reward, as_reward
from milestream.producers.rollout import RolloutContext, Sample, episode_sample, runs_agent_fn, worst_finish
from milestream.producers.sessions.openai_api import (ContextTooLong, SamplingRules, chat_completion, models_reply,
                                                      openai_error)
from milestream.producers.sessions.responses_api import responses
from milestream.producers.sessions.server import EngineBackend
from milestream.producers.sessions.templates import chat_template
from milestream.producers.sessions.tito import TokenSession
from milestream.schemas.records import Prompt

LOOPBACK = "127.0.0.1"


class AgentFailed(RuntimeError):
    """An episode the agent did not complete: the sample fails, its group is published as an error."""


class EpisodeBackend:
    """The engine behind one episode: its turns share the sample's routing key (one engine, its cache), and a
    turn that would pass the context limit is refused."""

    def __init__(self, engine: Engine, max_context_tokens: int) -> None:
        self.engine = EngineBackend(engine)
        self.max_context_tokens = max_context_tokens
        self.finish_reason: FinishReason = "stop"
        self.out_of_context = False

    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult:
        if len(input_ids) + sampling.max_new_tokens > self.max_context_tokens:
            self.finish_reason, self.out_of_context = "length", True
            raise ContextTooLong(f"{len(input_ids)} prompt tokens and max_tokens {sampling.max_new_tokens} pass "
                                 f"this run's context limit (rollout.max_context_tokens {self.max_context_tokens})")
        result = await self.engine.generate(input_ids, sampling, routing_key)
        self.finish_reason = worst_finish(self.finish_reason, result.finish_reason)
        return result


@dataclass(frozen=True)
class AgentEpisode:
    request_id: str  # the sample's: its turns' routing key
    api_key: str
    session: TokenSession
    backend: EpisodeBackend
    rules: SamplingRules
    model: str


class EpisodeServer:
    """OpenAI's API for the open episodes of one event loop, on loopback (the system picks the port)."""

    def __init__(self) -> None:
        self.episodes: dict[str, AgentEpisode] = {}
        self._runner = web.AppRunner(self._app(), access_log=None)
        self._started = asyncio.ensure_future(self._start())

    async def url(self) -> str:
        return await asyncio.shield(self._started)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._started
        await self._runner.cleanup()

    async def _start(self) -> str:
        await self._runner.setup()
        site = web.TCPSite(self._runner, LOOPBACK, 0)
        await site.start()
        return f"http://{LOOPBACK}:{self._runner.addresses[0][1]}"

    def _app(self) -> web.Application:
        # the Guard's browser checks (Host, Origin, JSON bodies); each episode's own key stands for a token
        guard = Guard(ControlToken(secrets.token_hex(16), "none: every route takes its episode's key"), LOOPBACK)
        app = web.Application(middlewares=[guard.middleware(lambda request: False, answer=openai_error)])
        app.add_routes([web.post("/episodes/{episode_id}/v1/chat/completions", self._chat_completions),
                        web.post("/episodes/{episode_id}/v1/responses", self._responses),
                        web.get("/episodes/{episode_id}/v1/models", self._models)])
        return app

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, chat_completion)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, responses)

    async def _turn(self, request: web.Request, api: Callable[..., Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        episode = self._episode(request)
        if isinstance(episode, web.Response):
            return episode
        generate = functools.partial(episode.backend.generate, routing_key=episode.request_id)
        return await api(request, episode.session, generate, episode.rules, episode.model)

    async def _models(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        return episode if isinstance(episode, web.Response) else models_reply(episode.model)

    def _episode(self, request: web.Request) -> AgentEpisode | web.Response:
        episode = self.episodes.get(request.match_info["episode_id"])
        if episode is None:
            return openai_error(HTTPStatus.NOT_FOUND, "no open episode here (it ended, or ran past "
                                "rollout.agent_timeout_s)")
        given = request.headers.get(hdrs.AUTHORIZATION, "").encode()
        if not hmac.compare_digest(given, authorization(episode.api_key)[hdrs.AUTHORIZATION].encode()):
            return openai_error(HTTPStatus.UNAUTHORIZED, "the api key is not this episode's (the one its agent "
                                "was called with)")
        return episode


_SERVERS: dict[asyncio.AbstractEventLoop, EpisodeServer] = {}


@contextlib.asynccontextmanager
async def served(episode_id: str, episode: AgentEpisode) -> AsyncIterator[str]:
    """The episode's base url while the context lasts; the loop's server starts with its first open
    episode and stops with its last."""
    loop = asyncio.get_running_loop()
    server = _SERVERS.get(loop)
    if server is None:
        server = _SERVERS[loop] = EpisodeServer()
    server.episodes[episode_id] = episode
    try:
        yield f"{await server.url()}/episodes/{episode_id}/v1"
    finally:
        del server.episodes[episode_id]
        if not server.episodes:
            if _SERVERS.get(loop) is server:
                del _SERVERS[loop]
            await server.stop()


@runs_agent_fn
async def openai_episode(ctx: RolloutContext, prompt: Prompt, request_id: str) -> Sample:
    """``rollout.agent_fn`` (base_url, api_key, prompt) over an episode session: one sample, exact tokens."""
    cfg = ctx.cfg
    rules = SamplingRules(cfg.rollout.max_new_tokens, cfg.rollout.temperature, for_training=True,
                          topk_logprobs=cfg.rollout.logprobs_topk)
    session = TokenSession(chat_template(ctx.tokenizer), cfg.sessions.match)
    backend = EpisodeBackend(ctx.engine, cfg.rollout.max_context_tokens)
    model = cfg.model.path or cfg.model.name
    episode = AgentEpisode(request_id, secrets.token_urlsafe(24), session, backend, rules, model)
    async with served(uuid.uuid4().hex, episode) as base_url:
        result, reported = _reported(ctx, episode, await _run_agent(ctx, episode, base_url, prompt))
    replies = session.replies()
    if not replies:
        raise AgentFailed(f"rollout.agent_fn {cfg.rollout.agent_fn} ended episode {request_id} without calling the "
                          f"model (its base_url was {base_url})")
    calls = sum(len(message.get("tool_calls") or ()) for message in replies)
    return episode_sample(ctx, session, backend.finish_reason, result, len(replies), calls, reported)


def _reported(ctx: RolloutContext, episode: AgentEpisode, result: Any) -> tuple[str | None, Reward | None]:
    """(the answer, the reward the agent reported) of what it returned; AgentFailed for another shape."""
    name = ctx.cfg.rollout.agent_fn
    if result is None or isinstance(result, str):
        return result, None
    if not isinstance(result, dict) or not result.keys() <= {"answer", "reward"}:
        shape = f"a dict with {sorted(map(str, result))}" if isinstance(result, dict) else f"a {type(result).__name__}"
        raise AgentFailed(f"rollout.agent_fn {name} returned {shape} in episode {episode.request_id}: expected the "
                          "answer text, None (the last assistant message), or {\"answer\": ..., \"reward\": ...}")
    answer = result.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise AgentFailed(f"rollout.agent_fn {name} returned an answer of type {type(answer).__name__} in episode "
                          f"{episode.request_id}: expected a string or None")
    if "reward" not in result:
        return answer, None
    try:
        return answer, as_reward(result["reward"], ctx.cfg.reward.key)
    except TypeError as exc:
        return answer, Reward(0.0, error=f"rollout.agent_fn {name} reported a reward in episode "
                                         f"{episode.request_id} that is not one: {exc}"[:500])


async def _run_agent(ctx: RolloutContext, episode: AgentEpisode, base_url: str, prompt: Prompt) -> Any:
    """What the agent returned within ``rollout.agent_timeout_s``; AgentFailed if it fails
    before the episode ran out of context (after that, what it does no longer matters)."""
    name, timeout_s = ctx.cfg.rollout.agent_fn, ctx.cfg.rollout.agent_timeout_s
    agent = _call(ctx.agent, base_url, episode.api_key, prompt)
    try:
        done, _ = await asyncio.wait({agent}, timeout=timeout_s)
    finally:
        agent.cancel()
    if episode.backend.out_of_context:
        return ""
    if not done:
        raise AgentFailed(f"rollout.agent_fn {name} did not return within rollout.agent_timeout_s {timeout_s:g} s "
                          f"(episode {episode.request_id})")
    try:
        result = agent.result()
    except Exception as exc:
        raise AgentFailed(f"rollout.agent_fn {name} failed in episode {episode.request_id}: "
                          f"{type(exc).__name__}: {exc}") from exc
    return result


def _call(agent: Callable[..., Any], *args: Any) -> asyncio.Future:
    """The agent's call as a future: an async agent as a task on this loop, a sync one in a thread of its own
    (not a pool's: a hung agent must not hold a worker thread others wait for)."""
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
        return asyncio.ensure_future(agent(*args))
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            value = agent(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the episode, which says what failed
            outcome = functools.partial(future.set_exception, exc)
        else:
            outcome = functools.partial(future.set_result, value)
        with contextlib.suppress(RuntimeError):  # the loop closed while the agent ran
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=f"agent {args[0]}", daemon=True).start()
    return future
