"""Remote engines over SGLang's HTTP API: ``HttpEngine`` (the ``Engine`` protocol, for the rollout
worker) and ``RouterClient`` (per-session generation through the affinity router).

Either talks to a milestream CPU engine server, an SGLang server, or a router in front of them: the
request and reply are SGLang's (/generate with input_ids, sampling_params and return_logprob; the
reply's meta_info.output_token_logprobs and weight_version). A CPU engine also returns the version of
every token (meta_info.output_token_weight_versions); from SGLang, every token gets the reply's
weight_version, which must then be an integer (start SGLang with ``--weight-version 0``).

A client given the run's control token (``token``: infra/secret_env.py ``control_token``) sends it as
``Authorization: Bearer`` with every request: the control routes (pause, continue, load a version, end a
session) refuse a request without it, and an SGLang server started with ``--api-key`` takes it the same way.

Engines behind the HTTP API hold whole models: a LoRA run's versions reach them with the adapters
merged into the base weights (``FullWeights``), never as adapter tensors a whole-model loader cannot take.
"""
from __future__ import annotations

import asyncio
import json
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import torch
from torch import Tensor

from milestream.config import Config, ModelConfig
from milestream.engines.engine import FinishReason, GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.http_api import (ROUTING_KEY_HEADER, authorization, client_session, reply_message,
                                         transport_failure)
from milestream.engines.scoring import ScoreRequest
from milestream.infra.model import load_model, load_trainable_state_dict, merged_weights
from milestream.infra.secret_env import control_token
from milestream.streams.weights.disk import prune, write_full

FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")
ROUTER_REPLY_MARGIN_S = 5.0


class EngineHttpError(RuntimeError):
    """An engine or router refused a request, could not be reached, or sent a reply we cannot read.
    ``status``: the HTTP status of a refusal (502 / 503 from the router: an engine down, its session
    lost), None when no reply came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def group_routing_key(request: GenerateRequest) -> str:
    """The rollout worker's request ids are GROUP/INDEX: a group's samples share an engine, whose
    prefill then runs their common prompt once."""
    return request.request_id.rsplit("/", 1)[0]


def generate_body(request: GenerateRequest) -> dict[str, Any]:
    sampling = request.sampling
    return {"rid": request.request_id, "input_ids": list(request.input_ids), "return_logprob": True,
            "sampling_params": {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                                "stop_token_ids": list(sampling.stop_token_ids)}}


def parse_generate_reply(reply: Any, request_id: str, source: str) -> GenerateResult:
    """A GenerateResult from SGLang's /generate reply; a field we cannot read is an error naming it."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    if not isinstance(meta, dict):
        raise EngineHttpError(f"{source}: reply for {request_id} has no meta_info object")
    pairs = meta.get("output_token_logprobs")
    if not isinstance(pairs, list):
        raise EngineHttpError(f"{source}: reply for {request_id} lacks meta_info.output_token_logprobs")
    try:
        logprobs, output_ids = [float(p[0]) for p in pairs], [int(p[1]) for p in pairs]
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineHttpError(f"{source}: meta_info.output_token_logprobs of {request_id} is not "
                              f"[[logprob, token_id, ...], ...]: {exc}") from None
    if "output_ids" in reply and list(reply["output_ids"]) != output_ids:
        raise EngineHttpError(f"{source}: output_ids and meta_info.output_token_logprobs of {request_id} disagree")
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in FINISH_REASONS:
        raise EngineHttpError(f"{source}: meta_info.finish_reason.type of {request_id} is {finish!r}, "
                              f"not one of {FINISH_REASONS}")
    versions = meta.get("output_token_weight_versions")
    if versions is None:
        versions = [_integer_version(meta.get("weight_version"), source)] * len(output_ids)
    if len(versions) != len(output_ids):
        raise EngineHttpError(f"{source}: meta_info.output_token_weight_versions of {request_id} has "
                              f"{len(versions)} entries for {len(output_ids)} tokens")
    return GenerateResult(request_id, tuple(output_ids), tuple(logprobs), tuple(int(v) for v in versions), finish)


def parse_score_reply(reply: Any, response_ids: Sequence[int], source: str) -> list[float]:
    """The response tokens' log-probs from the reply to a scoring request: the last entries of
    meta_info.input_token_logprobs, whose token ids must be the response's (so a server that starts its
    entries a position earlier or later than asked is read right, or refused)."""
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) < len(response_ids):
        raise EngineHttpError(f"{source}: a scoring reply without {len(response_ids)} meta_info.input_token_logprobs")
    try:
        tail = entries[len(entries) - len(response_ids):]
        logprobs, ids = [float(e[0]) for e in tail], [int(e[1]) for e in tail]
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineHttpError(f"{source}: meta_info.input_token_logprobs is not [[logprob, token_id, ...], ...] "
                              f"over the response: {exc}") from None
    if ids != list(response_ids):
        raise EngineHttpError(f"{source}: meta_info.input_token_logprobs end with tokens {ids[:8]}..., not the "
                              "response's")
    return logprobs


def _integer_version(raw: Any, source: str) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise EngineHttpError(f"{source}: meta_info.weight_version {raw!r} is not an integer version (start "
                              "SGLang with --weight-version 0; milestream sends each update's version)") from None


class FullWeights:
    """A LoRA policy's versions as whole-model weights, adapters merged into the base: what loaders of
    whole models (SGLang's update_weights_from_disk, milestream's engine server) take."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        self.model = load_model(model_cfg, dtype=torch.float32)  # the base the adapters merge into

    def __call__(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        load_trainable_state_dict(self.model, tensors)
        return merged_weights(self.model)


class HttpEngine:
    """The ``Engine`` protocol over HTTP. ``routing_key`` names each request's session for a router
    (ignored by a plain engine); ``weights_dir`` is where ``update_weights`` writes a version that the
    engines then load (in the run's weight folders, streams/weights/base.py ``engine_weights_dir``): whole-model
    weights, a LoRA ``model``'s merged; ``token``: the run's control token, for the control routes."""

    def __init__(self, url: str, *, routing_key: Callable[[GenerateRequest], str] = group_routing_key,
                 weights_dir: Path | None = None, key_header: str = ROUTING_KEY_HEADER,
                 timeout_s: float = 600.0, initial_version: int = 0, model: ModelConfig | None = None,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.routing_key, self.weights_dir, self.key_header = routing_key, weights_dir, key_header
        self._authorization = authorization(token) if token is not None else {}
        self._full_weights = FullWeights(model) if model is not None and model.lora_rank > 0 else None
        self.timeout_s = timeout_s
        self._client: aiohttp.ClientSession | None = None
        self._version = initial_version

    @property
    def version(self) -> int:
        """The newest version this client has seen applied or produce a token."""
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self.generate_keyed(request, self.routing_key(request))

    async def generate_keyed(self, request: GenerateRequest, routing_key: str) -> GenerateResult:
        reply = await self.post("/generate", generate_body(request), routing_key=routing_key)
        result = parse_generate_reply(reply, request.request_id, self.url)
        self._version = max([self._version, *result.versions])
        return result

    async def score(self, requests: Sequence[ScoreRequest]) -> list[list[float]]:
        """The log-prob of every response token (engines/scoring.py): one request each that generates nothing
        and asks for the input's log-probs; those sharing a prompt share a routing key, so a router sends them
        to one engine."""
        return list(await asyncio.gather(*(self._score(request) for request in requests)))

    async def _score(self, request: ScoreRequest) -> list[float]:
        if not request.response_ids:
            return []
        body = {"rid": uuid.uuid4().hex, "input_ids": [*request.prompt_ids, *request.response_ids],
                "return_logprob": True, "logprob_start_len": len(request.prompt_ids),
                "sampling_params": {"max_new_tokens": 0, "temperature": request.temperature}}
        key = f"score-{zlib.crc32(str(request.prompt_ids).encode()):08x}"
        reply = await self.post("/generate", body, routing_key=key)
        return parse_score_reply(reply, request.response_ids, self.url)

    async def pause(self) -> None:
        await self.post("/pause_generation", {"mode": "in_place"})

    async def resume(self) -> None:
        await self.post("/continue_generation", {})

    async def update_weights(self, version: int, tensors: Mapping[str, Tensor]) -> None:
        if self.weights_dir is None:
            raise ValueError("HttpEngine.update_weights needs weights_dir, a folder the engines can read; "
                             "or call update_weights_from_disk with a whole-model version file")
        if self._full_weights is not None:
            tensors = await asyncio.to_thread(self._full_weights, tensors)
        # step -1: this side only knows the version, not the trainer step that made it
        path, _, _ = await asyncio.to_thread(write_full, self.weights_dir, version, -1, tensors)
        await self.update_weights_from_disk(path, version)
        prune(self.weights_dir, keep_from=version)

    async def update_weights_from_disk(self, path: Path, version: int) -> None:
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's {self._version}")
        await self.post("/update_weights_from_disk", {"model_path": str(Path(path).resolve()),
                                                      "weight_version": str(version)})
        self._version = version

    async def post(self, path: str, payload: dict[str, Any], *, routing_key: str | None = None) -> Any:
        headers = {**self._authorization, **({self.key_header: routing_key} if routing_key is not None else {})}
        if self._client is None:  # created on the caller's loop
            self._client = client_session(self.timeout_s)
        try:
            async with self._client.post(self.url + path, json=payload, headers=headers) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise EngineHttpError(f"POST {self.url}{path}: HTTP {reply.status}: {reply_message(text)}",
                                          reply.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise EngineHttpError(f"POST {self.url}{path}: {transport_failure(exc, self.timeout_s)}") from exc
        return json.loads(text) if text else {}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class RouterClient:
    """Token-in-token-out generation through the router: the session service's ``GenerateBackend``
    (``generate(input_ids, sampling, routing_key)``, the same key on every turn of a session)."""

    def __init__(self, url: str, *, key_header: str = ROUTING_KEY_HEADER, timeout_s: float = 600.0,
                 token: str | None = None) -> None:
        self._http = HttpEngine(url, key_header=key_header, timeout_s=timeout_s, token=token)

    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult:
        if not routing_key:
            raise ValueError("routing_key: empty; every turn of a session carries the session's key")
        request = GenerateRequest(f"{routing_key}/{uuid.uuid4().hex[:12]}", tuple(input_ids), sampling)
        return await self._http.generate_keyed(request, routing_key)

    async def end_session(self, routing_key: str) -> bool:
        """Forget the session's engine; True if the router still held it."""
        return bool((await self._http.post("/end_session", {}, routing_key=routing_key))["released"])

    async def close(self) -> None:
        await self._http.close()


def router_backend(cfg: Config) -> RouterClient:
    """``sessions.backend=milestream.engines.http_engine:router_backend``: the router at router.host:port.
    It waits a little past the router's own timeout, so the router's answer, which names the engine that
    failed, arrives before this side gives up; it holds the run's control token, for /end_session."""
    return RouterClient(f"http://{cfg.router.host}:{cfg.router.port}", key_header=cfg.router.key_header,
                        timeout_s=cfg.router.request_timeout_s + ROUTER_REPLY_MARGIN_S,
                        token=control_token(cfg).value)
