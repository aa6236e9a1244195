"""Scoring given tokens (engines/scoring.py), a teacher's forward in on-policy distillation: under
rollout.true_on_policy a CpuEngine scores each token exactly as an engine of the same weights logged it when
it sampled it; an engine server answers SGLang's scoring request (max_new_tokens 0, prompt log-probs), and
HttpEngine.score reads it."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch

from milestream.config import Config
from milestream.engines.engine import CpuEngine, GenerateRequest, SamplingParams
from milestream.engines.http_engine import HttpEngine
from milestream.engines.scoring import ScoreRequest
from milestream_testkit.servers import MODEL, post_json, ready_urls, start, stop

PROMPTS = {(1, 2, 3, 4, 5): 1.0, (9, 8, 7): 0.7, tuple(range(100, 137)): 1.3}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def exact(dtype: str) -> Config:
    return Config().with_overrides(model={"name": "tiny-random", "dtype": dtype, "lora_rank": 0},
                                   rollout={"true_on_policy": True})


def sampled(engine: CpuEngine) -> list[tuple[GenerateRequest, tuple[float, ...], tuple[int, ...]]]:
    requests = [GenerateRequest(f"{i}/{j}", prompt, SamplingParams(n, temperature))
                for i, (prompt, temperature) in enumerate(PROMPTS.items()) for j, n in enumerate((5, 9, 2))]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return [(r, result.logprobs, result.output_ids) for r, result in zip(requests, asyncio.run(run()))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_score_is_the_logprob_the_engine_sampled_the_token_with(dtype: str) -> None:
    cfg = exact(dtype)
    student = CpuEngine(cfg.model, cfg.rollout, seed=5)
    teacher = CpuEngine(cfg.model, cfg.rollout, seed=9)
    try:
        rows = sampled(student)
        requests = [ScoreRequest(r.input_ids, ids, r.sampling.temperature) for r, _, ids in rows]
        scores = asyncio.run(teacher.score([*requests, ScoreRequest((1, 2), (), 1.0)]))
        assert scores[:-1] == [list(logprobs) for _, logprobs, _ in rows] and scores[-1] == []
    finally:
        for engine in (student, teacher):
            asyncio.run(engine.close())


def test_an_engine_server_answers_sglangs_scoring_request(tmp_path: Path) -> None:
    cfg = exact("float32")
    server = start(["engine", "--port", "0", *MODEL, "--set", "rollout.true_on_policy=true"], tmp_path / "engine.log")
    local = CpuEngine(cfg.model, cfg.rollout, seed=9)
    try:
        url = ready_urls(server, 1, tmp_path / "engine.log")["engine engine-0"]
        requests = [ScoreRequest(prompt, (7, 300, 12, 49151), temperature) for prompt, temperature in PROMPTS.items()]

        async def scenario() -> None:
            remote = HttpEngine(url)
            assert await remote.score(requests) == await local.score(requests)
            await remote.close()
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [4, 5, 6], "return_logprob": True, "logprob_start_len": 0,
                        "sampling_params": {"max_new_tokens": 0}}
                status, reply = await post_json(http, url + "/generate", body)
                assert status == 200 and reply["output_ids"] == []
                entries = reply["meta_info"]["input_token_logprobs"]
                assert [e[1] for e in entries] == [4, 5, 6] and entries[0][0] is None
                assert [e[0] for e in entries[1:]] == (await local.score([ScoreRequest((4,), (5, 6), 1.0)]))[0]
                status, reply = await post_json(http, url + "/generate", {**body, "return_logprob": False})
                assert status == 400 and reply["message"].startswith("return_logprob")

        asyncio.run(scenario())
    finally:
        stop(server)
        asyncio.run(local.close())
