"""The session service over real HTTP (loopback) with the tiny model on a CpuEngine."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import PreTrainedTokenizerBase

from milestream.config import RolloutConfig
from milestream.engines.engine import CpuEngine, GenerateResult, SamplingParams
from milestream.engines.http_api import Guard, authorization
from milestream.infra.secret_env import ControlToken
from milestream.producers.sessions.server import EngineBackend, SessionService
from milestream.producers.sessions.templates import chat_template


class KeyRecordingBackend(EngineBackend):
    def __init__(self, engine: CpuEngine) -> None:
        super().__init__(engine)
        self.calls: list[tuple[str, SamplingParams]] = []

    async def generate(self, input_ids: list[int], sampling: SamplingParams, routing_key: str) -> GenerateResult:
        self.calls.append((routing_key, sampling))
        return await super().generate(input_ids, sampling, routing_key)


async def conversation(client: TestClient, question: str) -> tuple[str, list[dict[str, Any]], list[dict]]:
    """Two turns of one session: (session id, the two chat replies, the samples at close)."""
    created = await client.post("/sessions", json={"match": "strict"})
    assert created.status == 201
    session_id = (await created.json())["session_id"]
    messages = [{"role": "user", "content": question}]
    replies = []
    for follow_up in ("And twice that?", None):
        answer = await client.post(f"/sessions/{session_id}/chat",
                                   json={"messages": messages, "sampling": {"max_new_tokens": 8, "temperature": 1.0}})
        assert answer.status == 200, await answer.text()
        replies.append(await answer.json())
        messages = [*messages, replies[-1]["message"], {"role": "user", "content": follow_up}]
    listed = await (await client.get(f"/sessions/{session_id}/samples")).json()
    closed = await (await client.delete(f"/sessions/{session_id}")).json()
    assert listed == closed
    return session_id, replies, closed["samples"]


async def bad_requests(client: TestClient) -> list[tuple[int, str]]:
    session_id = (await (await client.post("/sessions")).json())["session_id"]
    chat = f"/sessions/{session_id}/chat"
    answers = [
        await client.post(chat, json={"messages": [{"role": "robot", "content": "hi"}]}),
        await client.post(chat, json={"messages": [{"role": "user", "content": "hi"}], "sampling": {"top_k": 3}}),
        await client.post(chat, data=b"not json", headers={"Content-Type": "application/json"}),
        await client.post("/sessions", json={"match": "fuzzy"}),
        await client.get("/sessions/nope/samples"),
    ]
    await client.delete(f"/sessions/{session_id}")
    return [(answer.status, (await answer.json())["error"]) for answer in answers]


def test_session_service_over_http_with_the_tiny_model(make_engine: Callable[..., CpuEngine],
                                                       tokenizer: PreTrainedTokenizerBase) -> None:
    engine = make_engine()
    backend = KeyRecordingBackend(engine)
    service = SessionService(chat_template(tokenizer), backend, RolloutConfig())

    async def scenario() -> tuple[list, list]:
        guard = Guard(ControlToken("token", "the test"), "127.0.0.1")
        async with TestClient(TestServer(service.app(guard)), headers=authorization("token")) as client:
            runs = await asyncio.gather(conversation(client, "What is 2 + 3?"), conversation(client, "Name a color."))
            return runs, await bad_requests(client)

    runs, errors = asyncio.run(scenario())
    for session_id, replies, samples in runs:
        [sample] = samples  # two linear turns: one leaf
        expected_prompt = tokenizer.apply_chat_template(sample["messages"][:1], add_generation_prompt=True,
                                                        return_dict=True)["input_ids"]
        assert sample["prompt_ids"] == list(expected_prompt)
        assert sum(sample["loss_mask"]) == sum(reply["completion_tokens"] for reply in replies)
        assert [reply["message"] for reply in replies] == sample["messages"][1::2]
        assert_rollout_logprobs(engine, sample)
        assert [key for key, _ in backend.calls].count(session_id) == 2  # every turn routed by its session
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(sampling.stop_token_ids == (eot,) and sampling.max_new_tokens == 8 for _, sampling in backend.calls)
    assert [status for status, _ in errors] == [400, 400, 400, 400, 404]
    assert "messages[0].role" in errors[0][1] and "sampling" in errors[1][1] and "not JSON" in errors[2][1]
    assert "match" in errors[3][1] and "nope" in errors[4][1]


def assert_rollout_logprobs(engine: CpuEngine, sample: dict) -> None:
    """The kept log-probs are the engine's: a fresh forward over the whole sample reproduces them."""
    ids = sample["prompt_ids"] + sample["response_ids"]
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    start = len(sample["prompt_ids"])
    positions = [start + i for i, bit in enumerate(sample["loss_mask"]) if bit]
    expected = torch.stack([logp[p - 1, ids[p]] for p in positions])
    kept = torch.tensor([lp for lp, bit in zip(sample["logprobs"], sample["loss_mask"]) if bit])
    torch.testing.assert_close(kept, expected, atol=1e-4, rtol=0)
    assert all(v == 0 for v, bit in zip(sample["versions"], sample["loss_mask"]) if bit)
