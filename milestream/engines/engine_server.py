"""The CPU engine behind SGLang's HTTP API subset, so one client (``HttpEngine``) serves both.

Endpoints, with SGLang's field names:

  POST /generate                  input_ids, sampling_params {max_new_tokens, temperature, stop_token_ids},
                                  return_logprob, rid  ->  output_ids, meta_info {id, finish_reason,
                                  prompt_tokens, completion_tokens, weight_version, output_token_logprobs
                                  [[logprob, token_id, null], ...]}; milestream adds meta_info
                                  output_token_weight_versions (the version of every token) and engine_id.
                                  With max_new_tokens 0, return_logprob and logprob_start_len S >= 0 it
                                  scores the input instead (engines/scoring.py): meta_info input_token_logprobs,
                                  one [logprob, token_id, null] per input position from S (position 0 has
                                  none: null), at the request's temperature
  POST /pause_generation          {"mode": "in_place"} (the default here): no step runs until continue;
                                  requests in flight stay where they are
  POST /continue_generation
  POST /update_weights_from_disk  model_path: a milestream version file of whole-model weights
                                  (``vNNNNNN.safetensors``, checked against its own checksums; a LoRA run's
                                  merged, as HttpEngine writes them) in one of the run's weight folders
                                  (RUN_DIR/weights, RUN_DIR/engine-weights; symlinks resolved), else 403;
                                  weight_version: its version (default: from the file name)
  GET  /health, /get_model_info, /get_server_info, /get_weight_version

The three POSTs other than /generate are control routes: they need the run's control token
(``Authorization: Bearer TOKEN``, else 401; http_api.Guard). Every request is refused (403) when its Host is
not one of the server's names or its Origin another site's, and a body that is not JSON gets 415.

The engine is token-in-token-out, like SGLang started with ``--skip-tokenizer-init``: no ``text`` in or
out. Anything that would change what is sampled and that this engine does not implement (top_p < 1,
top_k, penalties, streaming, batched prompts) is refused with HTTP 400 naming the field, never ignored.
"""
from __future__ import annotations

import asyncio
import signal
import uuid
import zlib
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.scoring import ScoreRequest
from milestream.engines.http_api import (BadRequest, Guard, bad_request_as_400, error_response, int_field, int_list,
                                           json_object, number_field, serve_app)
from milestream.streams.weights.base import WeightVerificationError, in_weight_folders, version_of
from milestream.streams.weights.disk import read_verified_full

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# accepted only at the value that leaves sampling unchanged
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "min_new_tokens": 0, "frequency_penalty": 0.0,
                    "presence_penalty": 0.0, "repetition_penalty": 1.0}
CONTROL_ROUTES = frozenset({"/pause_generation", "/continue_generation", "/update_weights_from_disk"})
TEXT_ONLY_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}  # no text here
# sglang-router 0.3.2 re-serializes /generate with these fields at their defaults
NEUTRAL_REQUEST = {"stream": False, "top_logprobs_num": 0, "logprob_start_len": -1, "data_parallel_rank": None,
                   "model": None, "return_hidden_states": False, "background": False, "return_bytes": False,
                   "return_entropy": False}
LOGGING_ONLY_REQUEST = {"log_metrics", "no_logs", "return_text_in_logprobs"}  # no text, no server-side logs here


def parse_generate(body: dict[str, Any]) -> tuple[GenerateRequest, bool]:
    """(the engine request, return_logprob) from a /generate body."""
    rid, input_ids, return_logprob = _parse_request(body, {"rid", "input_ids", "sampling_params", "return_logprob"})
    return GenerateRequest(rid, input_ids, parse_sampling(body.get("sampling_params") or {})), return_logprob


def is_scoring(body: dict[str, Any]) -> bool:
    """A /generate body that generates nothing: SGLang's way to ask for the input's log-probs."""
    params = body.get("sampling_params")
    return isinstance(params, dict) and params.get("max_new_tokens") == 0


def parse_score(body: dict[str, Any]) -> tuple[str, ScoreRequest, int]:
    """(rid, the scoring request, logprob_start_len) from a /generate body that generates nothing."""
    rid, input_ids, return_logprob = _parse_request(
        body, {"rid", "input_ids", "sampling_params", "return_logprob", "logprob_start_len"})
    if not return_logprob:
        raise BadRequest("return_logprob", "a request that generates nothing (max_new_tokens 0) asks for the "
                         "input's log-probs: return_logprob true")
    start = int_field(body.get("logprob_start_len", -1), "logprob_start_len", minimum=0)
    if start >= len(input_ids):
        raise BadRequest("logprob_start_len", f"{start}, past the {len(input_ids)} input tokens")
    sampling = parse_sampling(body["sampling_params"], max_new_tokens_minimum=0)
    prompt = max(start, 1)  # the first token is predicted by nothing
    return rid, ScoreRequest(input_ids[:prompt], input_ids[prompt:], sampling.temperature), start


def _parse_request(body: dict[str, Any], known: set[str]) -> tuple[str, tuple[int, ...], bool]:
    """(rid, input_ids, return_logprob) of a /generate body whose other fields are ``known``."""
    if "input_ids" not in body:
        raise BadRequest("input_ids", "missing (the engine is token-in-token-out, like SGLang with "
                                      "--skip-tokenizer-init: no text)")
    _refuse_unsupported(body, {*known, *LOGGING_ONLY_REQUEST}, NEUTRAL_REQUEST, "")
    if body["input_ids"] and isinstance(body["input_ids"][0], list):
        raise BadRequest("input_ids", "batched prompts are not supported: send one request per prompt")
    input_ids = int_list(body["input_ids"], "input_ids")
    if not input_ids:
        raise BadRequest("input_ids", "empty")
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid", f"expected a string, got {rid!r}")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise BadRequest("return_logprob", f"expected true or false, got {return_logprob!r}")
    return rid, tuple(input_ids), return_logprob


def parse_sampling(params: Any, max_new_tokens_minimum: int = 1) -> SamplingParams:
    if not isinstance(params, dict):
        raise BadRequest("sampling_params", f"expected a JSON object, got {type(params).__name__}")
    known = {"max_new_tokens", "temperature", "stop_token_ids", *TEXT_ONLY_SAMPLING}
    _refuse_unsupported(params, known, NEUTRAL_SAMPLING, "sampling_params.")
    max_new_tokens = int_field(params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS),
                               "sampling_params.max_new_tokens", minimum=max_new_tokens_minimum)
    return SamplingParams(
        max_new_tokens=max(max_new_tokens, 1),  # 0: a scoring request, which samples nothing
        temperature=number_field(params.get("temperature", 1.0), "sampling_params.temperature", minimum=0.0),
        stop_token_ids=tuple(int_list(params.get("stop_token_ids") or [], "sampling_params.stop_token_ids")),
    )


def _refuse_unsupported(body: dict[str, Any], known: set[str], neutral: dict[str, Any], prefix: str) -> None:
    for name, value in body.items():
        if name in known:
            continue
        if name not in neutral:
            raise BadRequest(prefix + name, "not supported by the milestream CPU engine")
        if value != neutral[name]:
            raise BadRequest(prefix + name, f"only {neutral[name]!r} is supported by the milestream CPU engine")


def generate_reply(result: GenerateResult, prompt_tokens: int, return_logprob: bool, engine_id: str,
                   version: int) -> dict[str, Any]:
    """SGLang's /generate reply; the per-token versions and the engine id are milestream's additions."""
    meta: dict[str, Any] = {
        "id": result.request_id,
        "finish_reason": finish_reason(result),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        # the version at the end of the request; earlier tokens may be older (weights.inflight keep/retract)
        "weight_version": str(result.versions[-1] if result.versions else version),
        "output_token_weight_versions": list(result.versions),
        "engine_id": engine_id,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.logprobs, result.output_ids)]
    return {"output_ids": list(result.output_ids), "meta_info": meta}


def score_reply(rid: str, request: ScoreRequest, start: int, logprobs: list[float], engine_id: str,
                version: int) -> dict[str, Any]:
    """SGLang's reply to a request that generates nothing: the input's log-probs from ``start``."""
    tokens = request.prompt_ids + request.response_ids
    scored = [None] * (start == 0) + logprobs  # position 0 has no log-prob; the prompt starts at max(start, 1)
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(tokens),
            "completion_tokens": 0, "cached_tokens": 0, "weight_version": str(version), "engine_id": engine_id,
            "input_token_logprobs": [[lp, tok, None] for lp, tok in zip(scored, tokens[start:])],
            "output_token_logprobs": []}
    return {"output_ids": [], "meta_info": meta}


def finish_reason(result: GenerateResult) -> dict[str, Any]:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.output_ids[-1]}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "aborted by a weight update (weights.inflight=abort) or shutdown"}


class EngineServer:
    """One ``CpuEngine`` behind HTTP; counts the requests it holds so routers and tests can see load. It loads
    weight versions from ``run_dir``'s weight folders only."""

    def __init__(self, engine: CpuEngine, engine_id: str, model_name: str, run_dir: Path) -> None:
        self.engine, self.engine_id, self.model_name, self.run_dir = engine, engine_id, model_name, run_dir
        self.active = 0
        self.served = 0
        self.paused = False

    def app(self, guard: Guard) -> web.Application:
        middlewares = [guard.middleware(lambda request: request.path in CONTROL_ROUTES), bad_request_as_400]
        app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.post("/generate", self.generate), web.put("/generate", self.generate),
            web.post("/pause_generation", self.pause), web.post("/continue_generation", self.resume),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.get("/health", self.health), web.get("/health_generate", self.health),
            web.get("/get_model_info", self.model_info), web.get("/get_server_info", self.server_info),
            web.get("/get_weight_version", self.weight_version),
        ])
        return app

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_object(request)
        if is_scoring(body):
            return await self.score(body)
        engine_request, return_logprob = parse_generate(body)
        self.active += 1
        try:
            result = await self.engine.generate(engine_request)
        except Exception as exc:  # noqa: BLE001 - the caller gets the engine's error as SGLang's error body
            return self._failed(exc)
        finally:
            self.active -= 1
        self.served += 1
        if result.routing is not None:  # never drop a trajectory's routing record silently
            return error_response(HTTPStatus.NOT_IMPLEMENTED, f"engine {self.engine_id} recorded MoE expert routing "
                                  "(R3), which this HTTP API does not carry; run MoE rollouts on the in-process engine")
        return web.json_response(generate_reply(result, len(engine_request.input_ids), return_logprob,
                                                self.engine_id, self.engine.version))

    async def score(self, body: dict[str, Any]) -> web.Response:
        rid, score_request, start = parse_score(body)
        self.active += 1
        try:
            (logprobs,) = await self.engine.score([score_request])
        except Exception as exc:  # noqa: BLE001 - as a generation's
            return self._failed(exc)
        finally:
            self.active -= 1
        self.served += 1
        return web.json_response(score_reply(rid, score_request, start, logprobs, self.engine_id, self.engine.version))

    def _failed(self, exc: Exception) -> web.Response:
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine {self.engine_id}: {type(exc).__name__}: {exc}")

    async def pause(self, request: web.Request) -> web.Response:
        mode = (await json_object(request, optional=True)).get("mode", "in_place")
        if mode != "in_place":
            raise BadRequest("mode", f"{mode!r}: only 'in_place' is supported (requests in flight wait, "
                                     "then continue; weights.inflight decides what an update does to them)")
        await self.engine.pause()
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        await self.engine.resume()
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        given, version = parse_update_from_disk(await json_object(request))
        path = in_weight_folders(given, self.run_dir)
        if path is None:
            return error_response(HTTPStatus.FORBIDDEN, f"model_path {str(given)!r} is outside the run's weight "
                                  f"folders ({self.run_dir}/weights, {self.run_dir}/engine-weights, symlinks "
                                  "resolved): an engine loads versions of its own run only (its --run-dir)")
        try:
            tensors = await asyncio.to_thread(read_verified_full, path, version)
            await self.engine.update_weights(version, tensors)
        except (OSError, ValueError, WeightVerificationError) as exc:
            return web.json_response({"success": False, "message": f"{path}: {exc}", "num_paused_requests": 0},
                                     status=HTTPStatus.BAD_REQUEST)
        return web.json_response({"success": True, "num_paused_requests": 0,
                                  "message": f"Succeeded to update model weights. Weight version {version}."})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=HTTPStatus.OK)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "tokenizer_path": None, "is_generation": True,
                                  "weight_version": str(self.engine.version)})

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.version)})

    async def server_info(self, request: web.Request) -> web.Response:
        state = {"active_requests": self.active, "requests_served": self.served, "paused": self.paused}
        return web.json_response({"engine_id": self.engine_id, "model_path": self.model_name,
                                  "skip_tokenizer_init": True, "weight_version": str(self.engine.version),
                                  "internal_states": [state], "version": "milestream-cpu-engine"})


def parse_update_from_disk(body: dict[str, Any]) -> tuple[Path, int]:
    """(version file, version) from an /update_weights_from_disk body."""
    _refuse_unsupported(body, {"model_path", "weight_version"},
                        {"load_format": None, "abort_all_requests": False, "flush_cache": True}, "")
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise BadRequest("model_path", f"expected the path of a milestream weight version file, got {model_path!r}")
    path = Path(model_path)
    raw_version = body.get("weight_version")
    if raw_version is None:
        try:
            return path, version_of(path)
        except ValueError:
            raise BadRequest("weight_version", f"missing, and {path.name!r} is not named vNNNNNN.safetensors") from None
    try:
        return path, int(raw_version)
    except (TypeError, ValueError):
        raise BadRequest("weight_version", f"expected an integer version, got {raw_version!r}") from None


def serve_engine(cfg: Config, *, host: str, port: int, engine_id: str) -> None:
    """Load the policy, then serve it; prints ``engine serving http://HOST:PORT`` once ready."""
    configure_process(cfg.model)
    seed = cfg.model.seed * 1000 + zlib.crc32(engine_id.encode()) % 1000  # distinct samples per engine
    # a whole model, as SGLang holds: a LoRA run's versions arrive merged (http_engine.FullWeights)
    whole = cfg.model.model_copy(update={"lora_rank": 0})
    engine = CpuEngine(whole, cfg.rollout, seed=seed, inflight=cfg.weights.inflight)
    server = EngineServer(engine, engine_id, cfg.model.path or cfg.model.name, cfg.run_path.resolve())
    name = f"engine {engine_id}"
    asyncio.run(serve_app(server.app(Guard.of(cfg, host, name)), host, port, name=name, on_stop=engine.close))
