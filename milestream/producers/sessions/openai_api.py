"""OpenAI's chat completions in front of token-in-token-out sessions: an agent written for the ``openai``
package talks to the policy unchanged, and every turn it takes lands in its session as exact tokens.

    POST {base}/chat/completions   OpenAI's request (the subset below)   -> a chat.completion, or its SSE chunks
    GET  {base}/models                                                    -> the one model served

``base`` names one session: ``/sessions/{id}/v1`` on the session service (api key: the run's control
token), ``/episodes/{id}/v1`` on a rollout worker's episode server (producers/agents.py; api key: the
episode's own), so ``openai.OpenAI(base_url=..., api_key=...)`` is all an agent needs. Each request's
messages are matched against the session's stored histories as a ``/chat`` turn is (tito.py): the
history the agent sends back is the exact ids the model saw and generated, never its text tokenized
again; a request that extends an earlier history (a retry, a regenerated turn) starts a branch.

Supported: ``messages`` (string or text-part content; ``developer`` read as ``system``), ``tools`` with
``tool_choice`` ``auto`` (the model's ``<tool_call>`` blocks come back as ``tool_calls``), ``n`` (choices
of one prompt: sibling leaves), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``stop``
(strings that are one token of the vocabulary), ``logprobs`` / ``top_logprobs`` (up to
``rollout.logprobs_topk``, what the engine records), ``stream`` (Server-Sent Events: the reply, once
generated, as one delta per choice) with ``stream_options.include_usage``. What would change the sampling
and is not implemented here (``top_p`` below 1, penalties, ``logit_bias``, ``seed``, a forced
``tool_choice``, a JSON ``response_format``) and any other field gets a 400 naming it, never ignored.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web

from milestream.engines.engine import GenerateResult, SamplingParams
from milestream.engines.http_api import BadRequest, int_field, json_object, number_field
from milestream.producers.sessions.templates import ChatTemplate, TemplateError
from milestream.producers.sessions.tito import TokenSession

# accepted only at the value that leaves sampling unchanged (None: absent)
NEUTRAL = {"top_p": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
           "logit_bias": (None, {}), "seed": (None,), "tool_choice": (None, "auto"),
           "parallel_tool_calls": (None, True), "response_format": (None, {"type": "text"}),
           "modalities": (None, ["text"])}
IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier"})  # nothing sampled depends on them
READ = frozenset({"messages", "tools", "n", "max_tokens", "max_completion_tokens", "temperature", "stop",
                  "logprobs", "top_logprobs", "stream", "stream_options"})
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"})
NULL_MESSAGE_FIELDS = frozenset({"refusal", "audio", "function_call", "annotations"})  # empty when echoed back
_FIELD = re.compile(r"^([\w.\[\]]+):")
Generate = Callable[[list[int], SamplingParams], Awaitable[GenerateResult]]


class ContextTooLong(BadRequest):
    """A turn whose prompt and ``max_tokens`` pass the context limit (OpenAI's ``context_length_exceeded``)."""

    def __init__(self, problem: str) -> None:
        super().__init__("messages", problem)


@dataclass(frozen=True)
class SamplingRules:
    """What a request may ask of sampling on one endpoint."""

    max_new_tokens: int  # a request without max_tokens gets this many
    temperature: float  # ... and this temperature
    # the rollout worker's episodes: the trainer scores every token at rollout.temperature and within
    # rollout.max_new_tokens, so a request may not change the one nor pass the other
    for_training: bool = False
    topk_logprobs: int = 0  # the most top_logprobs the engine records (rollout.logprobs_topk)
    max_n: int = 16


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    n: int
    sampling: SamplingParams
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Choice:
    message: dict
    result: GenerateResult


@dataclass(frozen=True)
class Completion:
    model: str
    request: ChatRequest
    prompt_tokens: int
    choices: list[Choice]
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse_chat_request(body: Mapping[str, Any], rules: SamplingRules, template: ChatTemplate) -> ChatRequest:
    """The request, or BadRequest naming the first field this endpoint cannot honour."""
    check_fields(body, READ, NEUTRAL, IGNORED)
    if not isinstance(body.get("model"), str):
        raise BadRequest("model", "expected the model's name (any string: one policy is served)")
    top_logprobs = _optional_int(body, "top_logprobs", 0, rules.topk_logprobs)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool) or (top_logprobs and not logprobs):
        raise BadRequest("logprobs", f"expected a boolean (true when top_logprobs is asked), got {logprobs!r}")
    stream, options = body.get("stream") or False, body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"expected a boolean, got {stream!r}")
    if not isinstance(options, Mapping) or set(options) - {"include_usage"} or (options and not stream):
        raise BadRequest("stream_options", f"expected {{'include_usage': bool}} with stream true, got {options!r}")
    return ChatRequest(normalized_messages(body.get("messages")), _tools(body.get("tools")),
                       _optional_int(body, "n", 1, rules.max_n), _sampling(body, rules, template),
                       logprobs, top_logprobs, stream, bool(options.get("include_usage")))


def check_fields(body: Mapping[str, Any], read: frozenset[str], neutral: Mapping[str, tuple],
                 ignored: frozenset[str]) -> None:
    """BadRequest naming the first field of ``body`` an endpoint neither reads nor ignores, or sets to a value
    (``neutral``: the values that leave sampling unchanged) it does not implement."""
    for name, value in body.items():
        if name in neutral and value not in neutral[name]:
            shown = " or ".join(json.dumps(allowed) for allowed in neutral[name] if allowed is not None)
            raise BadRequest(name, f"{value!r} is not supported (only {shown}): the engine does not implement it, "
                             "and ignoring it would sample something else than asked")
        if name not in neutral and name not in ignored and name not in read:
            raise BadRequest(name, "not supported by this endpoint")


def _optional_int(body: Mapping[str, Any], name: str, default: int, maximum: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    value = int_field(value, name, minimum=0 if name == "top_logprobs" else 1)
    if value > maximum:
        raise BadRequest(name, f"at most {maximum} here, got {value}")
    return value


def _sampling(body: Mapping[str, Any], rules: SamplingRules, template: ChatTemplate) -> SamplingParams:
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    limit = body.get(limit_name)
    max_new_tokens = rules.max_new_tokens if limit is None else int_field(limit, limit_name, minimum=1)
    if rules.for_training:  # an upper bound: stopping sooner honours it
        max_new_tokens = min(max_new_tokens, rules.max_new_tokens)
    temperature = body.get("temperature")
    temperature = rules.temperature if temperature is None else number_field(temperature, "temperature", minimum=0)
    if rules.for_training and temperature != rules.temperature:
        raise BadRequest("temperature", f"{temperature:g}: this endpoint trains the policy at rollout.temperature "
                         f"{rules.temperature:g} (the trainer scores every token at it); leave it unset")
    stops = (template.end_of_turn_id, *_stop_ids(body.get("stop"), template))  # the end of turn first
    return SamplingParams(max_new_tokens, temperature, stops)


def _stop_ids(stop: Any, template: ChatTemplate) -> tuple[int, ...]:
    """A stop string is one token of the vocabulary: the engine stops on token ids, and cutting text that
    spans tokens would leave the model's last tokens half in the reply."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(strings, list) or len(strings) > 4:
        raise BadRequest("stop", f"expected a string or a list of up to 4 strings, got {stop!r}")
    ids = []
    for index, text in enumerate(strings):
        encoded = template.encode(text) if isinstance(text, str) else []
        if len(encoded) != 1:
            raise BadRequest(f"stop[{index}]", f"{text!r} is not one token of the model's vocabulary (the engine "
                             f"stops on tokens; it is {len(encoded)})")
        ids.extend(encoded)
    return tuple(ids)


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", f"expected a list of tools, got {type(tools).__name__}")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise BadRequest(f"tools[{index}]", "expected {'type': 'function', 'function': {...}}")
        if not isinstance(function.get("name"), str):
            raise BadRequest(f"tools[{index}].function.name", "expected a string")
    return tools or None


def normalized_messages(messages: Any) -> list[dict]:
    """OpenAI's messages as the session stores them: string content, the fields a turn keeps and no
    empty ones, so a message the endpoint returned and the agent sends back is the message stored."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "expected a non-empty list of message objects")
    return [_normalized(message, f"messages[{offset}]") for offset, message in enumerate(messages)]


def _normalized(message: Any, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise BadRequest(where, f"expected an object, got {type(message).__name__}")
    out: dict[str, Any] = {}
    for name, value in message.items():
        if name in NULL_MESSAGE_FIELDS and value in (None, [], ""):
            continue
        if name not in MESSAGE_FIELDS:
            raise BadRequest(f"{where}.{name}", "not supported by this endpoint")
        if value is not None:
            out[name] = value
    if out.get("role") == "developer":  # OpenAI's newer name for the system prompt
        out["role"] = "system"
    out["content"] = text_content(out.get("content"), f"{where}.content")
    if "tool_calls" in out:
        out["tool_calls"] = _tool_calls(out["tool_calls"], f"{where}.tool_calls")
    return out


def text_content(content: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> Any:
    """A message's content as one string: text parts (of ``part_types``) joined; anything else but a list as it
    is, for validate_messages to name."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    for index, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") in part_types and isinstance(part.get("text"), str)):
            raise BadRequest(f"{where}[{index}]", f"only text parts ({{'type': {part_types[0]!r}, 'text': ...}}) "
                             "are supported")
    return "".join(part["text"] for part in content)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise BadRequest(where, f"expected a list, got {type(calls).__name__}")
    out = []
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise BadRequest(f"{where}[{index}].function", "expected {'name': ..., 'arguments': ...}")
        kept = {"type": "function", "function": {"name": function.get("name"), "arguments": function.get("arguments")}}
        if call.get("id") is not None:
            kept["id"] = call["id"]
        out.append(kept)
    return out


# ---- a turn and its reply -----------------------------------------------------------------------------

async def chat_completion(request: web.Request, session: TokenSession, generate: Generate, rules: SamplingRules,
                          model: str) -> web.StreamResponse:
    """One turn of ``session``: the request's messages generated by ``generate`` (the session's backend with
    its routing key), answered as OpenAI does; a bad field is a 400 naming it, a failed generation a 502."""
    completion = await session_turn(request, session, generate, model,
                                    lambda body: parse_chat_request(body, rules, session.template))
    if isinstance(completion, web.Response):
        return completion
    if completion.request.stream:
        return await _stream(request, completion, session.template)
    return web.json_response(completion_body(completion, session.template))


async def session_turn(request: web.Request, session: TokenSession, generate: Generate, model: str,
                       parse: Callable[[dict[str, Any]], ChatRequest]) -> Completion | web.Response:
    """The turn a request asks of ``session`` (``parse``: its API's fields as a ChatRequest), or the error to
    answer: a 400 naming the field, a 502 with the backend's words."""
    try:
        chat = parse(await json_object(request))
        turn = session.begin(chat.messages, chat.tools)
    except (BadRequest, TemplateError) as exc:
        return openai_error(HTTPStatus.BAD_REQUEST, exc)
    try:
        results = await asyncio.gather(*(generate(list(turn.prompt_ids), chat.sampling) for _ in range(chat.n)))
    except BadRequest as exc:  # the episode's context limit
        return openai_error(HTTPStatus.BAD_REQUEST, exc)
    except Exception as exc:  # noqa: BLE001 - the agent gets the backend's own words (which engine failed, why)
        return openai_error(HTTPStatus.BAD_GATEWAY, f"generation failed: {exc}")
    stop_ids = chat.sampling.stop_token_ids[1:]  # the request's own (the first is the end of turn)
    choices = [Choice(session.finish(turn, r.output_ids, r.logprobs, r.versions, stop_ids), r) for r in results]
    return Completion(model, chat, len(turn.prompt_ids), choices)


def models_reply(model: str) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": model, "object": "model", "created": 0, "owned_by": "milestream"}]})


def openai_error(status: int, error: Exception | str) -> web.Response:
    """OpenAI's error body; ``param`` names the field of a 400."""
    message = str(error)
    named = _FIELD.match(message)  # a TemplateError starts with the field it names
    param = error.field if isinstance(error, BadRequest) else named[1] if named else None
    code = "context_length_exceeded" if isinstance(error, ContextTooLong) else None
    kind = "invalid_request_error" if status < 500 else "api_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}},
                             status=status)


def completion_body(completion: Completion, template: ChatTemplate) -> dict:
    choices = [{"index": index, "message": choice.message, "finish_reason": _finish_reason(choice),
                "logprobs": _logprobs(choice.result, completion.request, template)}
               for index, choice in enumerate(completion.choices)]
    versions = sorted({v for choice in completion.choices for v in choice.result.versions})
    return {**_head(completion, "chat.completion"), "choices": choices, "usage": _usage(completion),
            "weight_versions": versions}


def _head(completion: Completion, kind: str) -> dict:
    return {"id": completion.id, "object": kind, "created": completion.created, "model": completion.model}


def _usage(completion: Completion) -> dict:
    generated = sum(len(choice.result.output_ids) for choice in completion.choices)
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": generated,
            "total_tokens": completion.prompt_tokens + generated}


def _finish_reason(choice: Choice) -> str:
    if choice.result.finish_reason == "stop" and choice.message.get("tool_calls"):
        return "tool_calls"
    return choice.result.finish_reason  # stop, length, or abort (a weight update cut the turn short)


def _logprobs(result: GenerateResult, chat: ChatRequest, template: ChatTemplate) -> dict | None:
    if not chat.logprobs:
        return None
    tops: Sequence[Sequence[tuple[int, float]]] = [
        list(zip(ids, values))[:chat.top_logprobs] for ids, values in zip(result.topk_ids, result.topk_logprobs)
    ] if chat.top_logprobs and result.topk_ids else [()] * len(result.output_ids)
    return {"content": [{**_token(template, token, logprob),
                         "top_logprobs": [_token(template, *pair) for pair in top]}
                        for token, logprob, top in zip(result.output_ids, result.logprobs, tops)]}


def _token(template: ChatTemplate, token: int, logprob: float) -> dict:
    text = template.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


async def _stream(request: web.Request, completion: Completion, template: ChatTemplate) -> web.StreamResponse:
    """Server-Sent Events: per choice, a delta with the whole reply (the engine returns a turn at once),
    then its finish reason; the usage when asked; then ``[DONE]``."""
    reply = await event_stream(request)
    head = _head(completion, "chat.completion.chunk")
    for index, choice in enumerate(completion.choices):
        delta = {"role": "assistant", **choice.message}
        if "tool_calls" in delta:  # a streamed call says which one it continues
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(delta["tool_calls"])]
        logprobs = _logprobs(choice.result, completion.request, template)
        await send_event(reply, {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                      "logprobs": logprobs}]})
        finish = _finish_reason(choice)
        await send_event(reply, {**head, "choices": [{"index": index, "delta": {}, "finish_reason": finish}]})
    if completion.request.include_usage:
        await send_event(reply, {**head, "choices": [], "usage": _usage(completion)})
    await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply


async def event_stream(request: web.Request) -> web.StreamResponse:
    """A Server-Sent Events reply, its headers sent (both OpenAI APIs stream this way)."""
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await reply.prepare(request)
    return reply


async def send_event(reply: web.StreamResponse, data: dict, event: str | None = None) -> None:
    """One event: ``data`` as JSON, named ``event`` where the API names its events (Responses)."""
    named = f"event: {event}\n" if event else ""
    await reply.write(f"{named}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
