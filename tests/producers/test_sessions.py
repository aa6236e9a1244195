"""Token-in-token-out sessions: randomized round trips per registered template, the comparison
settings, truncated turns and reasoning.

The round trip's oracle renders whole prompts with the template (as an engine without sessions
would be sent them), with every generated assistant turn replaced by a sentinel, and cuts the
text at the sentinels: what lies between must be exactly the non-generated tokens of the sample,
and the generated ids must sit verbatim at the sentinels' places.
"""
from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field

import pytest
from transformers import PreTrainedTokenizerBase

from milestream.producers.sessions.qwen import load_qwen3_tokenizer
from milestream.producers.sessions.templates import ChatTemplate, chat_template
from milestream.producers.sessions.tito import SessionSample, TokenSession

CONVERSATIONS = 1000
WORDS = ["add", "the", " numbers", "résumé", "中文", "🙂", "x=1", "  two  spaces", "tab\there", "new\nline",
         "\n\n", "{json}", "<tool_call>", "</think>", "it's", "42", "-7", "ünïcödé", "end."]
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "Sum two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "lookup", "description": "Cherche un mot", "parameters": {
        "type": "object", "properties": {"word": {"type": "string"}}}}},
]


@functools.cache
def shared_qwen3_tokenizer() -> PreTrainedTokenizerBase:
    """Loaded once for this file and test_session_templates.py (never mutated by a test)."""
    return load_qwen3_tokenizer()


@pytest.fixture
def qwen3_tokenizer() -> PreTrainedTokenizerBase:
    return shared_qwen3_tokenizer()


@pytest.fixture(params=["smollm2", "qwen3"])
def template(request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
    chosen = chat_template(tokenizer if request.param == "smollm2" else request.getfixturevalue("qwen3_tokenizer"))
    assert chosen.name == request.param
    return chosen


def text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 6)))


@dataclass(frozen=True)
class Output:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    closed: bool  # ends with the end-of-turn token


class FakeGenerator:
    """Random token ids, or a well-formed answer with tool calls (and, for Qwen3, reasoning)."""

    def __init__(self, template: ChatTemplate, rng: random.Random, vocab_size: int) -> None:
        self.template, self.rng, self.vocab_size = template, rng, vocab_size

    def __call__(self, tools: list[dict] | None) -> Output:
        rng, eot = self.rng, self.template.end_of_turn_id
        if tools and rng.random() < 0.5:
            ids = self.template.encode(self._tool_answer(tools)) + [eot]
        else:
            ids = [self._token() for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.85:
                ids.append(eot)  # else: stopped by the length limit
        return Output(ids, [-rng.random() * 5 for _ in ids], [rng.randrange(5) for _ in ids], ids[-1] == eot)

    def _token(self) -> int:
        while (token := self.rng.randrange(self.vocab_size)) == self.template.end_of_turn_id:
            pass  # the engine stops at the end-of-turn token: it never appears inside a turn
        return token

    def _tool_answer(self, tools: list[dict]) -> str:
        rng = self.rng
        calls = [json.dumps({"name": rng.choice(tools)["function"]["name"],
                             "arguments": {"a": rng.randint(-9, 9), "word": text(rng)}}, ensure_ascii=False)
                 for _ in range(rng.randint(1, 2))]
        answer = "\n".join(([text(rng)] if rng.random() < 0.5 else []) + [f"<tool_call>\n{c}\n</tool_call>" for c in calls])
        if self.template.name == "qwen3" and rng.random() < 0.5:
            answer = f"<think>\n{text(rng)}\n</think>\n\n{answer}"
        return answer


@dataclass
class State:
    """A conversation the client holds after a generated turn, and the outputs inside it."""

    messages: list[dict]
    outputs: list[Output]
    prompt: list[int]  # what the session sent to the engine for the last output
    parent: int | None  # index of the state this one extended
    extended: bool = field(default=False)


def sentinel(k: int) -> str:
    return f"SENTINEL{k}"


def expected_prompt(template: ChatTemplate, messages: list[dict], outputs: list[Output],
                    tools: list[dict] | None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a prompt ``messages``, from whole-prompt renderings cut at sentinels."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(assistants) == len(outputs)
    blanked = [{"role": "assistant", "content": sentinel(assistants.index(i))} if m["role"] == "assistant" else m
               for i, m in enumerate(messages)]
    ids: list[int] = []
    mask: list[int] = []
    for k, upto in enumerate(assistants + [len(messages)]):
        rendered = template.render(blanked[:upto], tools, add_generation_prompt=True)
        if k > 0:  # the text after the previous generated turn (the sentinel occurs exactly once)
            _, rendered = rendered.split(sentinel(k - 1) + template.end_of_turn)
        piece = template.encode(rendered)
        ids += piece
        mask += [0] * len(piece)
        if k < len(outputs):
            ids += outputs[k].ids
            mask += [1] * len(outputs[k].ids)
            if not outputs[k].closed:
                ids.append(template.end_of_turn_id)
                mask.append(0)
    return ids, mask


def next_messages(rng: random.Random, last: dict) -> list[dict]:
    """What the client appends after an assistant turn: tool results for its calls, and/or user turns."""
    new = [{"role": "tool", "content": text(rng), "tool_call_id": call["id"], "name": call["function"]["name"]}
           for call in last.get("tool_calls", ())]
    if not new or rng.random() < 0.3:
        if rng.random() < 0.1:
            new.append({"role": "system", "content": text(rng)})
        new.append({"role": "user", "content": text(rng)})
    return new


Played = tuple[TokenSession, list[State], list[dict] | None]


def play(template: ChatTemplate, rng: random.Random, generate: FakeGenerator) -> Played:
    """One randomized conversation: linear turns, and in some a branch from an earlier turn."""
    session = TokenSession(template)
    tools = TOOLS[: rng.randint(1, 2)] if rng.random() < 0.6 else None
    states: list[State] = []
    opening = ([{"role": "system", "content": text(rng)}] if rng.random() < 0.5 else []) + [
        {"role": "user", "content": text(rng)}]
    messages, outputs, parent = opening, [], None
    for _ in range(rng.randint(1, 5)):
        prompt = session.prompt_ids(messages, tools)
        output = generate(tools)
        reply = session.record(output.ids, output.logprobs, output.versions)
        states.append(State(messages + [reply], outputs + [output], prompt, parent))
        if parent is not None:
            states[parent].extended = True
        parent = len(states) - 1
        if rng.random() < 0.25:  # branch: go back to after an earlier generated turn of some state
            parent = rng.randrange(len(states))
            keep = rng.randint(0, len(states[parent].outputs))
            while parent is not None and len(states[parent].outputs) > keep:
                parent = states[parent].parent
            if parent is None:
                messages, outputs = opening + [{"role": "user", "content": text(rng)}], []
                continue
        base = states[parent]
        messages, outputs = base.messages + next_messages(rng, base.messages[-1]), base.outputs
    return session, states, tools


def check_sample(template: ChatTemplate, sample: SessionSample, states: list[State], leaf: int,
                 tools: list[dict] | None) -> None:
    state = states[leaf]
    last = state.outputs[-1]
    ids, mask = expected_prompt(template, state.messages[:-1], state.outputs[:-1], tools)
    ids += last.ids + ([] if last.closed else [template.end_of_turn_id])
    mask += [1] * len(last.ids) + ([] if last.closed else [0])
    start = mask.index(1)
    assert sample.prompt_ids == ids[:start]
    assert sample.response_ids == ids[start:]
    assert sample.loss_mask == mask[start:]
    generated = [(lp, v) for output in state.outputs for lp, v in zip(output.logprobs, output.versions)]
    assert [(lp, v) for lp, v, bit in zip(sample.logprobs, sample.versions, sample.loss_mask) if bit] == generated
    assert all(lp == 0.0 and v == -1 for lp, v, bit in zip(sample.logprobs, sample.versions, sample.loss_mask)
               if not bit)
    # every prompt the engine got on the way here: this history's ids up to the generated turn
    turn: int | None = leaf
    while turn is not None:
        prompt = states[turn].prompt
        assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1
        turn = states[turn].parent


def test_randomized_conversations_round_trip_token_exact(template: ChatTemplate) -> None:
    rng = random.Random(f"tito-{template.name}")
    generate = FakeGenerator(template, rng, len(template.tokenizer))
    branched = tool_calls = 0
    for _ in range(CONVERSATIONS):
        session, states, tools = play(template, rng, generate)
        leaves = [i for i, s in enumerate(states) if not s.extended]
        samples = session.samples()
        assert len(samples) == len(leaves)
        by_messages = {json.dumps(s.messages, sort_keys=True): s for s in samples}
        for leaf in leaves:
            sample = by_messages[json.dumps(states[leaf].messages, sort_keys=True)]
            check_sample(template, sample, states, leaf, tools)
        branched += len(leaves) > 1
        tool_calls += any("tool_calls" in m for s in states for m in s.messages)
    assert branched > CONVERSATIONS // 10 and tool_calls > CONVERSATIONS // 10  # the mix was exercised



def first_turn(session: TokenSession, answer: str) -> tuple[list[dict], dict, list[int]]:
    """One generated turn answering ``answer``: (the request, the returned message, its ids)."""
    request = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 2 + 3?"}]
    session.prompt_ids(request, TOOLS)
    ids = session.template.encode(answer) + [session.template.end_of_turn_id]
    return request, session.record(ids, [-0.25] * len(ids), [7] * len(ids)), ids


@pytest.mark.parametrize("match", ["strict", "template", "loose"])
def test_comparison_settings_decide_extension_or_branch(template: ChatTemplate, match: str) -> None:
    answer = 'Let me  add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    # a change in a field the template reads (content whitespace, arguments formatting)
    session = TokenSession(template, match)
    request, reply, first = first_turn(session, answer)
    call = reply["tool_calls"][0]
    assert (call["function"], reply["content"]) == ({"name": "add", "arguments": '{"a": 2, "b": 3}'}, "Let me  add.")
    edited = {**reply, "content": "Let me add.", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]}
    tool = {"role": "tool", "content": "5", "tool_call_id": call["id"]}
    session.prompt_ids([*request, edited, tool], TOOLS)
    second = template.encode("5") + [template.end_of_turn_id]
    session.record(second, [-1.0] * len(second), [8] * len(second))
    samples = session.samples()
    if match == "loose":  # extends: the trainer sees the generated tokens, not the edited message
        [sample] = samples
        assert sum(sample.loss_mask) == len(first) + len(second)
        assert sample.messages[2] == reply and sample.response_ids[: len(first)] == first
    else:  # branches: the edited message is rendered by the template, loss mask 0
        assert len(samples) == 2 and [sum(s.loss_mask) for s in samples] == [len(first), len(second)]
        edited_ids = template.encode(template.render([edited]).split("assistant\n", 1)[1].split(template.end_of_turn)[0])
        assert _contains(samples[1].prompt_ids, edited_ids)
    # a change in a field no registered template reads (a tool result's tool_call_id)
    session = TokenSession(template, match)
    request, reply, first = first_turn(session, answer)
    session.prompt_ids([*request, reply, tool], TOOLS)
    second_reply = session.record(second, [-1.0] * len(second), [8] * len(second))
    renamed = {**tool, "tool_call_id": "renamed"}
    session.prompt_ids([*request, reply, renamed, second_reply, {"role": "user", "content": "ok"}], TOOLS)
    session.record(second, [-1.0] * len(second), [9] * len(second))
    assert len(session.samples()) == (2 if match == "strict" else 1)


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i: i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_truncated_turn_is_closed_as_scaffolding_and_reasoning_parsed(qwen3_tokenizer: PreTrainedTokenizerBase) -> None:
    template = chat_template(qwen3_tokenizer)
    session = TokenSession(template)
    request = [{"role": "user", "content": "Think first."}]
    prompt = session.prompt_ids(request)
    assert template.decode(prompt) == "<|im_start|>user\nThink first.<|im_end|>\n<|im_start|>assistant\n"
    ids = template.encode("<think>\nhmm, 2\n</think>\n\nIt is 2.")  # the length limit hit before <|im_end|>
    reply = session.record(ids, [-0.5] * len(ids), [3] * len(ids))
    assert reply == {"role": "assistant", "content": "It is 2.", "reasoning_content": "hmm, 2"}
    second = session.prompt_ids([*request, reply, {"role": "user", "content": "Sure?"}])
    assert second[: len(prompt)] == prompt and second[len(prompt): len(prompt) + len(ids) + 1] == ids + [
        template.end_of_turn_id]
    assert second[len(prompt) + len(ids) + 1:] == template.encode("\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")
    session.record([template.end_of_turn_id], [-0.1], [4])
    [sample] = session.samples()
    assert sample.response_ids[len(ids)] == template.end_of_turn_id and sample.loss_mask[len(ids)] == 0
    assert sample.loss_mask[-1] == 1 and sample.versions[-1] == 4
