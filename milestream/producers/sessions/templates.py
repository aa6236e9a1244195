"""Chat templates as code: the text a conversation renders to, and what a session appends per turn.

A session never re-renders what the model generated. What it needs from a template is the text
that follows a history ending right after a generated end-of-turn token when new messages are
appended: ``continuation``. Registered templates render one piece per message, so that text is the
tail of the last assistant piece plus the pieces of the new messages, rendered with the whole
conversation in view (Qwen merges consecutive tool results into one user turn). A registered template
is chosen by the tokenizer's vocabulary and, when the tokenizer carries a chat template, by rendering
probe conversations exactly as it does (the same vocabulary with another template is not ChatML).
Other tokenizers get ``GenericTemplate``: ``tokenizer.apply_chat_template`` rendered twice and cut by
difference of prefixes, turns ending with the token the template writes after an assistant message,
with a warning, and an error when their template is not prefix-stable (the prompt a stored turn was
generated after included).

Tool calls, in both registered templates, are Qwen's (Hermes-style) JSON blocks in the assistant
text, after the content and a newline::

    <tool_call>
    {"name": "add", "arguments": {"a": 1}}
    </tool_call>

Qwen3 reads them as added tokens and puts tool results in a user turn as ``<tool_response>`` blocks.
SmolLM2 (ChatML) has no tool format of its own; milestream gives it the same blocks as plain text,
the same tool list in its system turn, and tool results as ChatML ``tool`` turns (what SmolLM2's own
template does with that role). Without tools, SmolLM2's rendering equals its own Jinja template.
"""
from __future__ import annotations

import abc
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from milestream.infra.model import end_of_turn_token

log = logging.getLogger(__name__)

Message = Mapping[str, Any]
ROLES = ("system", "user", "assistant", "tool")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
NL = "\n"
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_CLOSING = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
_TOOL_CALL = re.compile(r"<tool_call>\n?(.*?)\n?</tool_call>", re.DOTALL)


class TemplateError(ValueError):
    """A conversation a template cannot render, naming the message (its offset) and field."""


class ChatTemplate(Protocol):
    name: str
    end_of_turn: str  # the text of the token an assistant turn ends with
    end_of_turn_id: int  # the engine's stop token

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(self, messages: Sequence[Message], tools: Sequence[Message] | None = None, *,
               add_generation_prompt: bool = False) -> str: ...

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Message] | None = None) -> str:
        """The text after ``history`` (empty, or ending with an assistant turn whose tokens stop at the
        end-of-turn token) when ``new`` is appended, up to and including the generation prompt."""
        ...

    def message_key(self, message: Message) -> str:
        """The fields of ``message`` this template reads, canonically: equal keys render equally."""
        ...

    def parse_assistant(self, text: str) -> dict[str, Any]:
        """The assistant message of a generated turn's text (end-of-turn token removed)."""
        ...


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def tojson(value: Any) -> str:
    """What the templates' ``tojson`` filter writes (transformers' Jinja environment)."""
    return json.dumps(value, ensure_ascii=False)


def validate_messages(messages: Any) -> None:
    """Raises TemplateError naming the offset and field of the first malformed message."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages: expected a non-empty list of message objects")
    for offset, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"messages[{offset}]: expected an object, got {type(message).__name__}")
        if message.get("role") not in ROLES:
            raise TemplateError(f"messages[{offset}].role: {message.get('role')!r} is not one of {ROLES}")
        content = message.get("content")
        if not (isinstance(content, str) or (content is None and message["role"] == "assistant")):
            raise TemplateError(f"messages[{offset}].content: expected a string, got {type(content).__name__}")
        for index, call in enumerate(message.get("tool_calls") or ()):
            _check_tool_call(call, f"messages[{offset}].tool_calls[{index}]")


def _check_tool_call(call: Any, where: str) -> None:
    function = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise TemplateError(f"{where}.function.name: expected a string")
    if not isinstance(function.get("arguments"), str | Mapping):
        raise TemplateError(f"{where}.function.arguments: expected a JSON string or an object")


def tool_call_blocks(message: Message) -> list[str]:
    blocks = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function["arguments"]
        arguments = arguments if isinstance(arguments, str) else tojson(arguments)
        blocks.append(f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>')
    return blocks


def assistant_body(content: str, message: Message, *, lead: str | None = None) -> str:
    """Content, then each tool call block on its own line (Qwen3's layout); the first block starts a
    new line when ``lead`` (the message's content before any reasoning was split off) is not empty."""
    blocks = tool_call_blocks(message)
    newline = "\n" if blocks and (content if lead is None else lead) else ""
    return content + newline + "\n".join(blocks)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool calls) of generated text; a block that is not a JSON call stays content."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        arguments = arguments if isinstance(arguments, str) else tojson(arguments)
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    if not calls:
        return text, []
    content = text[: text.index("<tool_call>")]
    return content.removesuffix("\n"), calls


class _TokenizerTemplate:
    """What every template does the same way: tokens in and out, tool calls parsed from text."""

    end_of_turn: str

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)

    def encode(self, text: str) -> list[int]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False)
        # The Rust tokenizer directly: transformers' encode adds ~1 ms of batching per call.
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def parse_assistant(self, text: str) -> dict[str, Any]:
        content, calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message


class _PieceTemplate(_TokenizerTemplate, abc.ABC):
    """A template rendered as one text piece per message (header folded into the first, the
    generation prompt appended after the last)."""

    name: str
    end_of_turn = IM_END
    generation_prompt = f"{IM_START}assistant\n"

    @abc.abstractmethod
    def pieces(self, messages: Sequence[Message], tools: Sequence[Message] | None) -> list[str]:
        """One text per message, each rendered with the whole conversation in view."""

    def render(self, messages: Sequence[Message], tools: Sequence[Message] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        text = "".join(self.pieces(messages, tools))
        return text + self.generation_prompt if add_generation_prompt else text

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Message] | None = None) -> str:
        pieces = self.pieces([*history, *new], tools)
        tail = ""
        if history:
            last = pieces[len(history) - 1]
            if history[-1]["role"] != "assistant" or self.end_of_turn not in last:
                raise TemplateError(f"messages[{len(history) - 1}]: a stored history must end with an assistant turn")
            tail = last[last.rindex(self.end_of_turn) + len(self.end_of_turn):]
        return tail + "".join(pieces[len(history):]) + self.generation_prompt

    def message_key(self, message: Message) -> str:
        return canonical([message["role"], message.get("content") or "", tool_call_blocks(message)])


def _tools_header(tools: Sequence[Message]) -> str:
    return _TOOLS_PREAMBLE + "".join("\n" + tojson(tool) for tool in tools) + _TOOLS_CLOSING


class SmolLM2Template(_PieceTemplate):
    """SmolLM2-Instruct's ChatML (a default system turn when none is given) plus milestream's tools."""

    name = "smollm2"

    def pieces(self, messages: Sequence[Message], tools: Sequence[Message] | None) -> list[str]:
        header = ""
        if messages and messages[0]["role"] != "system":
            header = self._turn("system", SMOLLM2_DEFAULT_SYSTEM, tools)
        out = []
        for offset, message in enumerate(messages):
            content = message.get("content") or ""
            if message["role"] == "assistant":
                content = assistant_body(content, message)
            out.append(self._turn(message["role"], content, tools if offset == 0 else None))
        if out:
            out[0] = header + out[0]
        return out

    @staticmethod
    def _turn(role: str, content: str, tools: Sequence[Message] | None) -> str:
        if role == "system" and tools:
            content = f"{content}\n\n{_tools_header(tools)}"
        return f"{IM_START}{role}\n{content}{IM_END}\n"


class Qwen3Template(_PieceTemplate):
    """Qwen3's chat template (thinking mode; tool calls as JSON, tool results in user turns)."""

    name = "qwen3"

    def pieces(self, messages: Sequence[Message], tools: Sequence[Message] | None) -> list[str]:
        last_query = _last_query_index(messages)
        out = []
        for offset, message in enumerate(messages):
            role = message["role"]
            if offset == 0 and role == "system":
                system = f"{message['content']}\n\n{_tools_header(tools)}" if tools else message["content"]
                out.append(f"{IM_START}system\n{system}{IM_END}\n")
                continue
            prefix = f"{IM_START}system\n{_tools_header(tools)}{IM_END}\n" if offset == 0 and tools else ""
            if role == "assistant":
                out.append(prefix + self._assistant(messages, offset, last_query))
            elif role == "tool":
                opens = offset == 0 or messages[offset - 1]["role"] != "tool"
                closes = offset == len(messages) - 1 or messages[offset + 1]["role"] != "tool"
                out.append(prefix + (f"{IM_START}user" if opens else "")
                           + f"\n<tool_response>\n{message['content']}\n</tool_response>"
                           + (f"{IM_END}\n" if closes else ""))
            else:
                out.append(f"{prefix}{IM_START}{role}\n{message['content']}{IM_END}\n")
        return out

    @staticmethod
    def _assistant(messages: Sequence[Message], offset: int, last_query: int) -> str:
        message = messages[offset]
        content, reasoning = _split_reasoning(message)
        shown = content
        # Qwen3 keeps the reasoning only of the turns after the last user query.
        if offset > last_query and (offset == len(messages) - 1 or reasoning):
            shown = f"<think>\n{reasoning.strip(NL)}\n</think>\n\n{content.lstrip(NL)}"
        return f"{IM_START}assistant\n{assistant_body(shown, message, lead=content)}{IM_END}\n"

    def message_key(self, message: Message) -> str:
        content, reasoning = _split_reasoning(message) if message["role"] == "assistant" else (message["content"], "")
        return canonical([message["role"], content, reasoning, tool_call_blocks(message)])

    def parse_assistant(self, text: str) -> dict[str, Any]:
        reasoning = None
        if "</think>" in text:
            head, _, text = text.partition("</think>")
            reasoning, text = head.removeprefix("<think>").strip("\n"), text.lstrip("\n")
        message = super().parse_assistant(text)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


def _split_reasoning(message: Message) -> tuple[str, str]:
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return content, reasoning
    if "</think>" in content:  # Qwen3's split: reasoning before the first </think>, content after the last
        parts = content.split("</think>")
        return parts[-1].lstrip("\n"), parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return content, ""


def _last_query_index(messages: Sequence[Message]) -> int:
    """The last user message that is not a tool result wrapped by hand; the last message if none."""
    for offset in range(len(messages) - 1, -1, -1):
        content = messages[offset].get("content")
        if messages[offset]["role"] == "user" and isinstance(content, str) and not (
            content.startswith("<tool_response>") and content.endswith("</tool_response>")
        ):
            return offset
    return len(messages) - 1


class GenericTemplate(_TokenizerTemplate):
    """Any tokenizer with a Jinja chat template: new text is the difference of two renderings. An
    assistant turn ends with the token the template writes after one (infra/model.py
    ``end_of_turn_token``), the engine's stop token too."""

    name = "generic"

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise TemplateError(f"tokenizer {tokenizer.name_or_path!r} has no chat template")
        try:
            self.end_of_turn = end_of_turn_token(tokenizer)
        except ValueError as exc:
            raise TemplateError(str(exc)) from None
        super().__init__(tokenizer)

    def render(self, messages: Sequence[Message], tools: Sequence[Message] | None = None, *,
               add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(message) for message in messages], tools=list(tools) if tools else None,
            tokenize=False, add_generation_prompt=add_generation_prompt,
        )

    def continuation(self, history: Sequence[Message], new: Sequence[Message],
                     tools: Sequence[Message] | None = None) -> str:
        full = self.render([*history, *new], tools, add_generation_prompt=True)
        if not history:
            return full
        # The stored ids of the history came from the prompt its last turn was generated after; a
        # template that renders that prompt otherwise once messages follow (one moving the system
        # prompt into the last user turn) would give the model text it never saw, the system prompt twice.
        self._require_prefix(full, self.render(history[:-1], tools, add_generation_prompt=True), history,
                             "the prompt of its last assistant turn")
        before = self.render(history, tools)
        if self.end_of_turn not in before:
            raise TemplateError(f"{self.tokenizer.name_or_path!r}: the rendered history has no {self.end_of_turn!r}")
        cut = before.rindex(self.end_of_turn) + len(self.end_of_turn)
        self._require_prefix(full, before[:cut], history, f"the first {len(history)} messages")
        return full[cut:]

    def _require_prefix(self, full: str, prefix: str, history: Sequence[Message], what: str) -> None:
        if full.startswith(prefix):
            return
        at = next((i for i, (a, b) in enumerate(zip(full, prefix)) if a != b), min(len(full), len(prefix)))
        raise TemplateError(
            f"messages[{len(history) - 1}]: {self.tokenizer.name_or_path!r}'s chat template renders {what} "
            f"differently once more messages are appended (from character {at}: {prefix[at:at + 30]!r} became "
            f"{full[at:at + 30]!r}); the generic handler needs a template whose rendering of a history is a prefix "
            "of any longer one"
        )

    def message_key(self, message: Message) -> str:
        return canonical(message)  # what an unknown template reads is unknown: every field


def _is_smollm2(tokenizer: PreTrainedTokenizerBase) -> bool:
    return len(tokenizer) == 49_152 and tokenizer.convert_tokens_to_ids([IM_START, IM_END]) == [1, 2]


def _is_qwen3(tokenizer: PreTrainedTokenizerBase) -> bool:
    return tokenizer.convert_tokens_to_ids([IM_START, IM_END, "<tool_call>", "</think>"]) == [
        151_644, 151_645, 151_657, 151_668]


REGISTERED: tuple[tuple[Callable[[PreTrainedTokenizerBase], bool], type[_PieceTemplate]], ...] = (
    (_is_smollm2, SmolLM2Template),
    (_is_qwen3, Qwen3Template),
)
# renders every registered template's system turn, default system turn, both turns and generation prompt
_PROBES = (
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
)


def renders_like(tokenizer: PreTrainedTokenizerBase, template: ChatTemplate) -> bool:
    """Whether the tokenizer's own chat template renders the probe conversations as ``template`` does;
    True for a tokenizer without one (its vocabulary alone identifies it)."""
    if not tokenizer.chat_template:
        return True
    return all(tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
               == template.render(probe, add_generation_prompt=True) for probe in _PROBES)


def chat_template(tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
    """The registered template whose vocabulary and rendering match this tokenizer's, or the generic
    one; either way a log line names it (and ``.name`` tells a caller)."""
    for matches, registered in REGISTERED:
        if matches(tokenizer):
            template = registered(tokenizer)
            if renders_like(tokenizer, template):
                log.info("chat template of tokenizer %r: %s (template as code)", tokenizer.name_or_path, template.name)
                return template
            log.warning("tokenizer %r has %s's vocabulary but a chat template of its own", tokenizer.name_or_path,
                        template.name)
    generic = GenericTemplate(tokenizer)
    log.warning("no registered chat template for tokenizer %r: falling back to the generic handler "
                "(apply_chat_template by difference of prefixes, turns ending with %r; tool calls parsed as "
                "<tool_call> JSON)", tokenizer.name_or_path, generic.end_of_turn)
    return generic
