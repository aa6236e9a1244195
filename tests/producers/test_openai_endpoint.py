"""OpenAI's chat completions over token-in-token-out sessions, driven by the real ``openai`` client.

The tool-calling episode runs the example agent (examples/openai_agent/agent.py) on a scripted engine, so
that a tool call happens for sure; the other tests run the tiny random policy on a CpuEngine. Every engine
is wrapped to record what it was asked and what it returned, which the samples must equal token for token.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from transformers import PreTrainedTokenizerBase

from milestream.config import Config, RolloutConfig
from milestream.engines.engine import CpuEngine
from milestream.engines.http_api import Guard
from milestream.infra.kafka import RecordConsumer
from milestream.infra.model import load_tokenizer
from milestream.infra.secret_env import ControlToken
from milestream.producers.agents import AgentFailed, openai_episode
from milestream.producers.loader import load_prompts
from milestream.producers.rollout import Sample
from milestream.producers.sessions.server import EngineBackend, SessionService
from milestream.producers.sessions.templates import chat_template
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.records import Prompt
from openai_agents import OPENAI_LAYERS, CalculatorScript, Recording, agent_cfg, context, prompt, with_agent

TOKEN = "control-token"


# ---- an episode: the samples are the engine's tokens ------------------------------------------------

def test_a_tool_calling_episode_is_the_engines_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    cfg = agent_cfg()
    engine = Recording(CalculatorScript(tokenizer))
    ctx = context(cfg, engine, tokenizer)
    task = prompt("Solve this problem: 4 + 7 =", "11")
    sample = asyncio.run(openai_episode(ctx, task, "g#0/0"))

    [(first, called), (second, answered)] = engine.turns
    assert second.input_ids[:len(first.input_ids) + len(called.output_ids)] == first.input_ids + called.output_ids
    appended = list(second.input_ids[len(first.input_ids) + len(called.output_ids):])
    assert "<|im_start|>tool\n11<|im_end|>" in tokenizer.decode(appended)  # the tool's result, as a tool turn
    assert sample.prompt_ids == list(first.input_ids)
    assert sample.response_ids == list(called.output_ids) + appended + list(answered.output_ids)
    assert sample.loss_mask == [1] * len(called.output_ids) + [0] * len(appended) + [1] * len(answered.output_ids)
    assert sample.logprobs == list(called.logprobs) + [0.0] * len(appended) + list(answered.logprobs)
    assert sample.versions == list(called.versions) + [1] * len(appended) + list(answered.versions)
    assert (sample.turns, sample.tool_calls, sample.finish_reason) == (2, 1, "stop")
    assert sample.answer_text == "<answer>11</answer>"
    (reward,) = asyncio.run(ctx.score(task, [sample]))
    assert reward.value == pytest.approx(1.1) and not reward.error
    assert {request.request_id.rsplit("/", 1)[0] for request, _ in engine.turns} == {"g#0/0"}  # one routing key


def test_an_agent_on_the_responses_api_is_the_engines_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    """The same episode through ``client.responses.create``: the output items sent back as input are matched
    to the exact ids the engine generated (one leaf), and a stateful request is refused naming its field."""
    from examples.openai_agent.agent import solve_with_responses

    engine = Recording(CalculatorScript(tokenizer))
    ctx = with_agent(context(agent_cfg(), engine, tokenizer), solve_with_responses)
    task = prompt("Solve this problem: 4 + 7 =", "11")
    sample = asyncio.run(openai_episode(ctx, task, "g#0/0"))
    [(first, called), (second, answered)] = engine.turns
    appended = list(second.input_ids[len(first.input_ids) + len(called.output_ids):])
    assert second.input_ids[:len(first.input_ids) + len(called.output_ids)] == first.input_ids + called.output_ids
    assert "<|im_start|>tool\n11<|im_end|>" in tokenizer.decode(appended)
    assert sample.prompt_ids == list(first.input_ids)
    assert sample.response_ids == list(called.output_ids) + appended + list(answered.output_ids)
    assert sample.loss_mask == [1] * len(called.output_ids) + [0] * len(appended) + [1] * len(answered.output_ids)
    assert (sample.turns, sample.tool_calls, sample.answer_text) == (2, 1, "<answer>11</answer>")

    refused: list[openai.BadRequestError] = []

    def stateful(base_url: str, api_key: str, given: Prompt) -> str:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        first = client.responses.create(model="policy", input=given.question, max_output_tokens=8)
        for asked in ({"previous_response_id": first.id}, {"max_output_tokens": 0},
                      {"stream": True, "stream_options": {"include_obfuscation": False}},
                      {"input": [{"role": "user", "content": "Hi"}, {"type": "web_search_call", "id": "ws_1"}]}):
            try:
                client.responses.create(model="policy", **{"input": "And then?", **asked})
            except openai.BadRequestError as exc:
                refused.append(exc)
        return first.output_text

    ctx = with_agent(context(agent_cfg(), CalculatorScript(tokenizer), tokenizer), stateful)
    asyncio.run(openai_episode(ctx, task, "g#0/1"))
    assert [exc.body["param"] for exc in refused] == ["previous_response_id", "max_output_tokens", "stream_options",
                                                      "input[1].type"]


def test_an_agent_streaming_the_responses_api_is_the_engines_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    """The calculator episode streamed, the tool call by ``responses.create(stream=True)``, the answer by
    ``responses.stream``: OpenAI's events in order, and the completed output, sent back as input, is matched
    to the exact ids the engine generated."""
    from examples.openai_agent.agent import RESPONSE_TOOLS, SYSTEM, answer, run_tool

    streamed: list[list] = []

    def agent(base_url: str, api_key: str, given: Prompt) -> str:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        ask = {"model": "policy", "instructions": SYSTEM, "tools": RESPONSE_TOOLS}
        items: list = [{"role": "user", "content": given.question}]
        streamed.append(list(client.responses.create(**ask, input=items, stream=True)))
        output = streamed[0][-1].response.output
        (call,) = output
        items += [*output, {"type": "function_call_output", "call_id": call.call_id, "output": run_tool(call)}]
        with client.responses.stream(**ask, input=items) as stream:
            streamed.append(list(stream))
            return answer(stream.get_final_response().output_text)

    engine = Recording(CalculatorScript(tokenizer))
    ctx = with_agent(context(agent_cfg(), engine, tokenizer), agent)
    sample = asyncio.run(openai_episode(ctx, prompt("Solve this problem: 4 + 7 =", "11"), "g#0/0"))
    [(first, called), (second, answered)] = engine.turns
    appended = list(second.input_ids[len(first.input_ids) + len(called.output_ids):])
    assert sample.response_ids == list(called.output_ids) + appended + list(answered.output_ids)
    assert (sample.turns, sample.tool_calls, sample.answer_text) == (2, 1, "<answer>11</answer>")

    call_events, answer_events = streamed
    assert [event.type.removeprefix("response.") for event in call_events] == [
        "created", "in_progress", "output_item.added", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done", "completed"]
    assert call_events[3].delta == call_events[4].arguments == call_events[-1].response.output[0].arguments
    assert [event.type.removeprefix("response.") for event in answer_events] == [
        "created", "in_progress", "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done", "completed"]
    assert answer_events[4].delta == answer_events[4].snapshot == "<answer>11</answer>"
    for events in streamed:
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert {event.response.id for event in events if hasattr(event, "response")} == {events[-1].response.id}
        assert {event.item.id for event in events if hasattr(event, "item")} == \
            {event.item_id for event in events if hasattr(event, "item_id")} == {events[-1].response.output[0].id}


def test_a_streamed_response_ends_as_the_unstreamed_one_or_incomplete(make_engine: Callable[..., CpuEngine],
                                                                      tokenizer: PreTrainedTokenizerBase) -> None:
    """``response.completed`` carries the response a request without ``stream`` gets (the scripted tool call);
    cut at ``max_output_tokens``, the stream ends ``response.incomplete`` and its text is the sample's reply."""
    from examples.openai_agent.agent import RESPONSE_TOOLS

    question = {"model": "policy", "input": "Solve this problem: 4 + 7 =", "tools": RESPONSE_TOOLS}

    async def scenario(engine: Any, *asked: dict) -> tuple[list, list[dict]]:
        service = SessionService(chat_template(tokenizer), EngineBackend(engine), RolloutConfig(max_new_tokens=8))
        runner, _, base_url = await session_client(service)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
        replies = []
        for request in asked:
            reply = await client.responses.create(**request)
            replies.append([event async for event in reply] if request.get("stream") else reply)
        samples = await session_samples(base_url)
        await client.close()
        await runner.cleanup()
        return replies, samples

    (plain, events), _ = asyncio.run(scenario(CalculatorScript(tokenizer), question, {**question, "stream": True}))
    streamed = events[-1].response
    assert events[-1].type == "response.completed" and streamed.status == plain.status == "completed"
    unnamed = {"id", "created_at", "output", "weight_versions"}  # the script's weights change every turn
    assert streamed.model_dump(exclude=unnamed) == plain.model_dump(exclude=unnamed)
    assert [item.model_dump(exclude={"id", "call_id"}) for item in streamed.output] == \
        [item.model_dump(exclude={"id", "call_id"}) for item in plain.output]

    engine = Recording(make_engine())
    ([events], [sample]) = asyncio.run(scenario(engine, {"model": "policy", "input": "Hi", "max_output_tokens": 2,
                                                         "stream": True}))
    cut = events[-1].response
    assert (events[-1].type, cut.incomplete_details.reason) == ("response.incomplete", "max_output_tokens")
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == cut.output_text == sample["messages"][-1]["content"]
    [(_, result)] = engine.turns
    generated = [token for token, bit in zip(sample["response_ids"], sample["loss_mask"]) if bit]
    assert generated == list(result.output_ids) and cut.usage.output_tokens == 2


def test_concurrent_episodes_do_not_mix(make_engine: Callable[..., CpuEngine],
                                        tokenizer: PreTrainedTokenizerBase) -> None:
    """Eight async agents at once, two turns each, on the tiny policy: each sample is its own conversation
    and exactly the tokens, log-probs and versions its engine calls returned."""
    cfg = agent_cfg(max_new_tokens=6)
    engine = Recording(make_engine())
    seen_urls: set[str] = set()

    async def chat_twice(base_url: str, api_key: str, task: Prompt) -> None:
        seen_urls.add(base_url)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages: list = [{"role": "user", "content": task.question}]
        for follow_up in ("And then?", None):
            reply = (await client.chat.completions.create(model="policy", messages=messages)).choices[0].message
            messages += [reply, {"role": "user", "content": follow_up}] if follow_up else [reply]
        await client.close()

    ctx = with_agent(context(cfg, engine, tokenizer), chat_twice)
    questions = [f"Question number {index}?" for index in range(8)]

    async def episodes() -> list[Sample]:
        return await asyncio.gather(*(openai_episode(ctx, prompt(q), f"g#0/{i}") for i, q in enumerate(questions)))

    samples = asyncio.run(episodes())
    assert len(seen_urls) == 8
    by_id = {request.request_id: (request, result) for request, result in engine.turns}
    assert len(by_id) == 16  # two turns per episode, each routed by its sample's key
    for index, (question, sample) in enumerate(zip(questions, samples)):
        (first, one), (second, two) = by_id[f"g#0/{index}/0"], by_id[f"g#0/{index}/1"]
        for request in (first, second):
            assert re.findall(r"Question number \d+\?", tokenizer.decode(request.input_ids)) == [question]
        assert sample.prompt_ids == list(first.input_ids)
        generated = [(t, lp, v) for t, m, lp, v in zip(sample.response_ids, sample.loss_mask, sample.logprobs,
                                                       sample.versions) if m]
        assert generated == list(zip(one.output_ids + two.output_ids, one.logprobs + two.logprobs,
                                     one.versions + two.versions))
        assert sample.prompt_ids + sample.response_ids[:len(second.input_ids) - len(first.input_ids)] == \
            list(second.input_ids)


def test_a_reward_reads_the_transcript_or_the_agent_reports_its_own(tokenizer: PreTrainedTokenizerBase,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """reward.fn reads the episode's conversation (the tool's turn included); an agent that reports a reward
    is not scored by the configured one; a reported reward that is not a number is that sample's reward error,
    and a result of another shape fails the episode, naming what came back."""
    from examples.openai_agent.agent import DEMO, solve

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "plugins"))
    task = prompt("Solve this problem: 4 + 7 =", "11")

    def reports(reward: Any) -> Callable[..., dict]:
        def agent(base_url: str, api_key: str, given: Prompt) -> dict:
            return {"answer": solve(base_url, api_key, given), "reward": reward}
        return agent

    cfg = agent_cfg().with_overrides(reward={"fn": "reward_hooks:tool_use"})
    ctx = context(cfg, CalculatorScript(tokenizer), tokenizer)
    sample = asyncio.run(openai_episode(ctx, task, "g#0/0"))
    demo = [message["role"] for message in DEMO]  # the agent's worked example comes first
    assert [message["role"] for message in sample.transcript] == ["system", *demo, "user", "assistant", "tool",
                                                                   "assistant"]
    (scored,) = asyncio.run(ctx.score(task, [sample]))
    assert scored.components == {"tool_results": 2.0, "answered": 1.0} and scored.value == 3.0

    for reported, expected in ((0.25, (0.25, {})), ({"judge": 0.5, "style": 0.25}, (0.75, {"judge": 0.5, "style": 0.25}))):
        ctx = with_agent(context(cfg, CalculatorScript(tokenizer), tokenizer), reports(reported))
        sample = asyncio.run(openai_episode(ctx, task, "g#0/1"))
        (reward,) = asyncio.run(ctx.score(task, [sample]))
        assert (reward.value, dict(reward.components), reward.error) == (*expected, "")
        assert sample.answer_text == "<answer>11</answer>"

    ctx = with_agent(context(cfg, CalculatorScript(tokenizer), tokenizer), reports(float("nan")))
    (reward,) = asyncio.run(ctx.score(task, [asyncio.run(openai_episode(ctx, task, "g#0/2"))]))
    assert "reported a reward in episode g#0/2" in reward.error and "nan" in reward.error

    def odd_shape(base_url: str, api_key: str, given: Prompt) -> dict:
        solve(base_url, api_key, given)
        return {"answer": "11", "score": 1.0}

    ctx = with_agent(context(cfg, CalculatorScript(tokenizer), tokenizer), odd_shape)
    with pytest.raises(AgentFailed, match=r"returned a dict with \['answer', 'score'\] in episode g#0/3"):
        asyncio.run(openai_episode(ctx, task, "g#0/3"))


# ---- agents that fail ---------------------------------------------------------------------------------

def test_an_agent_that_raises_hangs_or_never_calls_fails_its_sample(tokenizer: PreTrainedTokenizerBase) -> None:
    engine = CalculatorScript(tokenizer)
    cfg = agent_cfg(agent_timeout_s=0.5)
    release = threading.Event()
    after_timeout: list[openai.APIError] = []

    def raises(base_url: str, api_key: str, task: Prompt) -> str:
        openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": task.question}])
        raise KeyError("the agent's own bug")

    def hangs(base_url: str, api_key: str, task: Prompt) -> None:
        release.wait()  # set once the episode has failed: its next request finds the episode closed
        try:
            openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).models.list()
        except (openai.NotFoundError, openai.APIConnectionError) as exc:  # 404, or refused once the server is down
            after_timeout.append(exc)

    async def never_calls(base_url: str, api_key: str, task: Prompt) -> str:
        return "42"

    task = prompt("Solve this problem: 1 + 2 =", "3")
    for agent, why in ((raises, "failed in episode g#0/0: KeyError"), (hangs, "did not return within"),
                       (never_calls, "without calling the model")):
        with pytest.raises(AgentFailed, match=why):
            asyncio.run(openai_episode(with_agent(context(cfg, engine, tokenizer), agent), task, "g#0/0"))
    release.set()
    for thread in threading.enumerate():
        if thread.name.startswith("agent http://"):
            thread.join()
    assert len(after_timeout) == 1  # closed at the timeout: an agent looping on the model would end too


# ---- the session service's endpoint -------------------------------------------------------------------

async def session_client(service: SessionService) -> tuple[web.AppRunner, str, str]:
    """The service on loopback, one session opened: (runner, the service's url, the session's base url)."""
    runner = web.AppRunner(service.app(Guard(ControlToken(TOKEN, "the test"), "127.0.0.1")))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        session_id = (await (await http.post(f"{url}/sessions")).json())["session_id"]
    return runner, url, f"{url}/sessions/{session_id}/v1"


async def session_samples(base_url: str) -> list[dict]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        return (await (await http.get(base_url.removesuffix("/v1") + "/samples")).json())["samples"]


def test_a_streamed_completion_and_its_logprobs(make_engine: Callable[..., CpuEngine],
                                                tokenizer: PreTrainedTokenizerBase) -> None:
    engine = Recording(make_engine())
    service = SessionService(chat_template(tokenizer), EngineBackend(engine), RolloutConfig(max_new_tokens=8))

    async def scenario() -> tuple[list, Any, list[dict]]:
        runner, _, base_url = await session_client(service)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0)
        messages: list = [{"role": "user", "content": "Name a color."}]
        first = (await client.chat.completions.create(model="policy", messages=messages, logprobs=True)).choices[0]
        messages += [first.message, {"role": "user", "content": "Another one?"}]
        stream = await client.chat.completions.create(model="policy", messages=messages, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        samples = await session_samples(base_url)
        await client.close()
        await runner.cleanup()
        return chunks, first, samples

    chunks, first, samples = asyncio.run(scenario())
    [(_, one), (second, two)] = engine.turns
    assert [(entry.token, entry.logprob) for entry in first.logprobs.content] == \
        [(tokenizer.decode([t]), lp) for t, lp in zip(one.output_ids, one.logprobs)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    [sample] = samples  # the second turn extended the first: one leaf
    assert streamed == sample["messages"][-1]["content"] and finish == [two.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(two.output_ids)
    assert chunks[-1].usage.prompt_tokens == len(second.input_ids)
    assert sample["prompt_ids"] + sample["response_ids"][:len(second.input_ids) - len(sample["prompt_ids"])] == \
        list(second.input_ids)  # the first reply, sent back, is its exact ids: never re-tokenized


def test_malformed_requests_get_a_400_naming_the_field(make_engine: Callable[..., CpuEngine],
                                                       tokenizer: PreTrainedTokenizerBase) -> None:
    engine = Recording(make_engine())
    service = SessionService(chat_template(tokenizer), EngineBackend(engine), RolloutConfig(max_new_tokens=4))
    user = [{"role": "user", "content": "hi"}]
    bad: list[tuple[dict, str]] = [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"messages": user, "top_p": 0.5}, "top_p"),
        ({"messages": user, "temperature": "hot"}, "temperature"),
        ({"messages": user, "n": 0}, "n"),
        ({"messages": user, "max_tokens": -3}, "max_tokens"),
        ({"messages": user, "stop": ["no such single token"]}, "stop[0]"),
        ({"messages": user, "top_logprobs": 2, "logprobs": True}, "top_logprobs"),  # the engine records none
        ({"messages": user, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"messages": user, "tool_choice": "required"}, "tool_choice"),
        ({"messages": user, "seed": 7}, "seed"),
        ({"messages": user, "extra_body": {"guided_json": {}}}, "guided_json"),
        ({"messages": user, "stream_options": {"include_usage": True}}, "stream_options"),
    ]

    async def scenario() -> list[tuple[int, Any]]:
        runner, url, base_url = await session_client(service)
        client = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=60)
        answers = []
        for request, _ in bad:
            try:
                await client.chat.completions.create(model="policy", **request)
                answers.append((200, None))
            except openai.APIStatusError as exc:
                answers.append((exc.status_code, exc.body))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            raw = await http.post(f"{base_url}/chat/completions", data=b"{not json",
                                  headers={"Content-Type": "application/json"})
            answers.append((raw.status, (await raw.json())["error"]))
        unauthorized = openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await unauthorized.models.list()
        await client.close()
        await unauthorized.close()
        await runner.cleanup()
        return answers

    answers = asyncio.run(scenario())
    for (status, body), (_, field) in zip(answers, [*bad, ({}, "request body")]):
        assert status == 400 and body["param"] == field, (field, status, body)
    assert not engine.turns  # nothing was generated for a request it refused


def test_an_episode_refuses_another_temperature_and_stops_at_the_context_limit(
        tokenizer: PreTrainedTokenizerBase) -> None:
    engine = Recording(CalculatorScript(tokenizer))
    cfg = agent_cfg(max_context_tokens=400)
    refusals: list[openai.BadRequestError] = []

    def agent(base_url: str, api_key: str, task: Prompt) -> str:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": task.question}]
        for ask in ({"temperature": 0.2}, {"max_tokens": 10_000}, {"messages": messages * 40}):
            try:
                client.chat.completions.create(model="policy", **{"messages": messages, **ask})
            except openai.BadRequestError as exc:
                refusals.append(exc)
        raise RuntimeError("gives up: a truncated episode is trained all the same")

    sample = asyncio.run(openai_episode(with_agent(context(cfg, engine, tokenizer), agent),
                                        prompt("Solve this problem: 2 + 2 =", "4"), "g#0/0"))
    assert [exc.body["param"] for exc in refusals] == ["temperature", "messages"]
    assert refusals[1].body["code"] == "context_length_exceeded"
    [(request, _)] = engine.turns  # max_tokens above rollout.max_new_tokens is capped, not refused
    assert request.sampling.max_new_tokens == cfg.rollout.max_new_tokens
    assert (sample.finish_reason, sample.answer_text, sample.turns) == ("length", "", 1)


# ---- through the worker --------------------------------------------------------------------------------

def failing_agent(base_url: str, api_key: str, task: Prompt) -> str:
    """Raises after one turn, for the worker test (an import path: rollout.agent_fn)."""
    openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task.question}])
    raise ValueError("the agent's own bug")


def test_the_worker_publishes_a_failed_agents_group_as_an_error(cfg: Config) -> None:
    """Every sample of a group whose agent failed is published as an error naming why: the processor drops
    the group (reason error) and gives its credit back, and the prompt is done."""
    cfg = cfg.with_overrides(rollout={**OPENAI_LAYERS, "agent_fn": f"{__name__}:failing_agent", "group_size": 2,
                                      "max_new_tokens": 64, "max_errors": 1000})
    load_prompts(cfg, count=2)
    tokenizer = load_tokenizer(cfg.model)
    worker = RolloutWorker(cfg, "w-openai", CalculatorScript(tokenizer), tokenizer)
    worker.weights_ready.set()  # the scripted engine needs no weights
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(
        partitions=range(cfg.broker.partitions))
    seen: list = []

    async def until_published(count: int) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        hang_guard = time.monotonic() + 120
        while len(seen) < count and not task.done() and time.monotonic() < hang_guard:
            for delivery in await asyncio.to_thread(trajectories.drain, 0.5, 5.0):
                seen.extend(delivery.records)
        stop.set()
        await task

    asyncio.run(until_published(2 * cfg.rollout.group_size))
    trajectories.close()
    assert {(t.status, t.response_ids == []) for t in seen} == {("error", True)}
    assert all("AgentFailed: rollout.agent_fn" in t.error and "ValueError: the agent's own bug" in t.error
               for t in seen)
