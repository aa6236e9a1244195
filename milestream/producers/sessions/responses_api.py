"""OpenAI's Responses API in front of the same token-in-token-out sessions as chat completions:

    POST {base}/responses   OpenAI's request (the subset below)   -> a response object

It is stateless, as an agent that sends its whole conversation each turn uses it: ``input`` (a string, or
a list of items) is read as chat messages and goes through the session as a chat completion's messages do
(openai_api.py), so the history an agent sends back (``input + response.output`` and its tool outputs) is
matched against the exact ids the model saw and generated, never tokenized again. Items: ``message``
(roles user, system, developer, assistant; string content or ``input_text`` / ``output_text`` parts),
``function_call`` (the model's tool call, returned in ``output``), ``function_call_output`` (a tool's
result), ``reasoning`` (a model's reasoning, returned in ``output`` where the template parses one).
Consecutive ``reasoning``, assistant ``message`` and ``function_call`` items are one assistant turn, as
``output`` lists them. Read: ``model``, ``input``, ``instructions`` (a system message first), ``tools``
(function tools), ``max_output_tokens``, ``temperature``, ``stream`` (Server-Sent Events as OpenAI sends
them: each output item added, its text or arguments in one delta once the turn is generated, as chat
completions stream, and done; last ``response.completed``, or ``response.incomplete`` when cut, with the
response a request without ``stream`` gets). Accepted at the value that changes nothing: ``tool_choice``
auto, ``parallel_tool_calls`` true, ``top_p`` 1, ``text`` format text, ``truncation`` disabled, ``include``
empty. ``previous_response_id`` and ``conversation`` (the server keeping a conversation),
``stream_options`` and any other field get a 400 naming it.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from milestream.engines.http_api import BadRequest, int_field
from milestream.producers.sessions.openai_api import (ChatRequest, Completion, Generate, SamplingRules,
                                                      check_fields, event_stream, parse_chat_request, send_event,
                                                      session_turn, text_content)
from milestream.producers.sessions.templates import ChatTemplate
from milestream.producers.sessions.tito import TokenSession

NEUTRAL = {"tool_choice": (None, "auto"), "parallel_tool_calls": (None, True), "top_p": (None, 1),
           "text": (None, {"format": {"type": "text"}}), "truncation": (None, "disabled"), "include": (None, [])}
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})  # nothing sampled depends on them
READ = frozenset({"model", "input", "instructions", "tools", "max_output_tokens", "temperature", "stream"})
STATEFUL = frozenset({"previous_response_id", "conversation"})
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"},
             "reasoning": {"type", "summary", "id", "status"}}
ROLES = ("user", "system", "developer", "assistant")


async def responses(request: web.Request, session: TokenSession, generate: Generate, rules: SamplingRules,
                    model: str) -> web.StreamResponse:
    """One turn of ``session`` asked through the Responses API; a bad field is a 400 naming it."""
    completion = await session_turn(request, session, generate, model,
                                    lambda body: parse_responses_request(body, rules, session.template))
    if isinstance(completion, web.Response):
        return completion
    body = response_body(completion)
    if completion.request.stream:
        return await _stream(request, body)
    return web.json_response(body)


def parse_responses_request(body: Mapping[str, Any], rules: SamplingRules, template: ChatTemplate) -> ChatRequest:
    """The request as the chat request it stands for, or BadRequest naming the field of this API."""
    if stateful := sorted(STATEFUL & body.keys()):
        raise BadRequest(stateful[0], "not supported: this endpoint keeps no responses; send the whole conversation "
                         "as input (the previous input, the response's output and the tools' outputs)")
    check_fields(body, READ, NEUTRAL, IGNORED)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions", f"expected a string, got {type(instructions).__name__}")
    if body.get("max_output_tokens") is not None:
        int_field(body["max_output_tokens"], "max_output_tokens", minimum=1)
    messages = [{"role": "system", "content": instructions}] if instructions else []
    chat = {"model": body.get("model"), "messages": messages + input_messages(body.get("input")),
            "tools": chat_tools(body.get("tools")), "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "stream": body.get("stream")}
    try:
        return parse_chat_request({k: v for k, v in chat.items() if v is not None}, rules, template)
    except BadRequest as exc:  # named as this API names it
        renamed = {"max_tokens": "max_output_tokens"}.get(exc.field) or (
            "input" if exc.field.startswith("messages") else exc.field)
        raise BadRequest(renamed, str(exc).removeprefix(f"{exc.field}: ")) from None


def input_messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("input", "expected a string or a non-empty list of items")
    messages: list[dict] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind not in ITEM_KEYS:
            raise BadRequest(f"{where}.type" if kind else where, f"expected an item of type {sorted(ITEM_KEYS)}")
        for key in set(item) - ITEM_KEYS[kind]:
            if item[key] is not None:
                raise BadRequest(f"{where}.{key}", "not supported by this endpoint")
        _read_item(kind, item, where, messages)
    return messages


def _read_item(kind: str, item: Mapping[str, Any], where: str, messages: list[dict]) -> None:
    if kind == "function_call":
        call = {"type": "function", "id": _string(item, "call_id", where),
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        _turn(messages).setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _string(item, "output", where)})
    elif kind == "reasoning":
        summary = item.get("summary")
        if not isinstance(summary, list) or not all(isinstance(p, Mapping) and isinstance(p.get("text"), str)
                                                    for p in summary):
            raise BadRequest(f"{where}.summary", "expected a list of {'type': 'summary_text', 'text': ...}")
        messages.append({"role": "assistant", "content": "", "reasoning_content": "".join(p["text"] for p in summary)})
    else:
        role = item.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role", f"{role!r} is not one of {ROLES}")
        text = text_content(item.get("content"), f"{where}.content", ("input_text", "output_text"))
        if not isinstance(text, str):
            raise BadRequest(f"{where}.content", "expected a string or a list of text parts")
        last = messages[-1] if messages else {}
        if role == "assistant" and last.get("role") == "assistant" and not last["content"] and "tool_calls" not in last:
            last["content"] = text  # the turn its reasoning item opened
        else:
            messages.append({"role": role, "content": text})


def _turn(messages: list[dict]) -> dict:
    """The assistant turn the items being read belong to: the last message if it is one, else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise BadRequest(f"{where}.{key}", f"expected a string, got {type(item.get(key)).__name__}")
    return item[key]


def chat_tools(tools: Any) -> list[dict] | None:
    """Responses' function tools (``{"type", "name", "parameters", ...}``) as chat completions' tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", f"expected a list of tools, got {type(tools).__name__}")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{index}]", "expected a function tool {'type': 'function', 'name': ..., "
                             "'parameters': {...}}")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def response_body(completion: Completion) -> dict:
    (choice,) = completion.choices
    message, result = choice.message, choice.result
    items: list[dict] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [
            {"type": "summary_text", "text": message["reasoning_content"]}]})
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": []}]})
    for call in message.get("tool_calls", ()):
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call["id"], "status": "completed",
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"]})
    cut = {"length": "max_output_tokens", "abort": "interrupted"}.get(result.finish_reason)
    generated = len(result.output_ids)
    request = completion.request
    return {
        "id": _id("resp"), "object": "response", "created_at": completion.created, "model": completion.model,
        "status": "incomplete" if cut else "completed", "incomplete_details": {"reason": cut} if cut else None,
        "output": items, "error": None, "instructions": None, "metadata": {},
        "tools": [{"type": "function", **tool["function"]} for tool in request.tools or ()],
        "tool_choice": "auto", "parallel_tool_calls": True, "temperature": request.sampling.temperature,
        "top_p": 1.0, "max_output_tokens": request.sampling.max_new_tokens, "text": {"format": {"type": "text"}},
        "usage": {"input_tokens": completion.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": completion.prompt_tokens + generated},
        "weight_versions": sorted(set(result.versions)),
    }


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def _stream(request: web.Request, body: dict) -> web.StreamResponse:
    """Server-Sent Events as OpenAI streams a response: created and in progress (no output yet), each item of
    ``body`` added, its content in one delta (the engine returns a turn at once) and done, then ``body`` itself
    as ``response.completed`` or ``response.incomplete``, the event its status names."""
    reply = await event_stream(request)
    # the client takes a lifecycle event's response as the one it accumulates output into
    pending = {**body, "status": "in_progress", "output": [], "incomplete_details": None, "usage": None}
    events = [{"type": "response.created", "response": pending}, {"type": "response.in_progress", "response": pending}]
    for index, item in enumerate(body["output"]):
        events += _item_events(index, item)
    events.append({"type": f"response.{body['status']}", "response": body})
    for number, event in enumerate(events):
        await send_event(reply, {**event, "sequence_number": number}, event["type"])
    await reply.write_eof()
    return reply


def _item_events(index: int, item: dict) -> list[dict]:
    """One output item's events: added without its content (the client appends each delta to it), the
    content, then done with the item as ``output`` lists it."""
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "message":
        (part,) = item["content"]
        content = _part_events({**at, "content_index": 0}, part, "content_part", "output_text", logprobs=[])
        added = {**item, "status": "in_progress", "content": []}
    elif item["type"] == "function_call":
        content = [{"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                   {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]}]
        added = {**item, "status": "in_progress", "arguments": ""}
    else:  # reasoning, its summary one part
        (part,) = item["summary"]
        content = _part_events({**at, "summary_index": 0}, part, "reasoning_summary_part", "reasoning_summary_text")
        added = {**item, "summary": []}
    return [{"type": "response.output_item.added", "output_index": index, "item": added}, *content,
            {"type": "response.output_item.done", "output_index": index, "item": item}]


def _part_events(at: dict, part: dict, part_event: str, text_event: str, **text_fields: Any) -> list[dict]:
    return [{"type": f"response.{part_event}.added", **at, "part": {**part, "text": ""}},
            {"type": f"response.{text_event}.delta", **at, "delta": part["text"], **text_fields},
            {"type": f"response.{text_event}.done", **at, "text": part["text"], **text_fields},
            {"type": f"response.{part_event}.done", **at, "part": part}]
