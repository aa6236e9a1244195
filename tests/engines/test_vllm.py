"""vLLM's CPU build as a rollout engine (engines/vllm.py), against one real server for the module: token ids in,
ids, log-probs and versions out; weight versions through vLLM's own routes, verified by its /weight_checker;
in-flight requests kept or aborted across an update; a LoRA version merged; a server killed and started again.

Skipped, with the reason, where .venv-vllm is absent or vLLM cannot start on this machine's CPU."""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from milestream.config import Config, ModelConfig
from milestream.engines.engine import GenerateRequest, SamplingParams
from milestream.engines.http_engine import EngineHttpError
from milestream.engines.vllm import SERVED_NAME, VllmEngine
from milestream.infra.model import load_model, load_tokenizer, trainable_state_dict
from milestream.producers.tasks import chat_input_ids
from milestream.streams.weights.base import WeightVerificationError
from milestream_testkit.servers import CONTROL_TOKEN
from milestream_testkit.vllm_server import VllmServer, VllmUnavailable

MODEL = ModelConfig(lora_rank=0)  # SmolLM2-135M-Instruct, served whole
# -O0: no compilation at start (minutes on a loaded 2-core machine); what is tested does not depend on it
CFG = Config(model=MODEL, run={"control_token": CONTROL_TOKEN}, rollout={"max_batch": 8}, vllm={"extra_args": ["-O0"]})
LONG = 300  # tokens a request in flight is asked for (paused after its first chunk, so it never finishes early)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[VllmServer]:
    try:
        served = VllmServer(CFG, tmp_path_factory.mktemp("vllm") / "vllm.log")
    except VllmUnavailable as exc:
        pytest.skip(str(exc))
    yield served
    served.stop()


def engine(server: VllmServer, tmp_path: Path, **options) -> VllmEngine:
    return VllmEngine(server.url, weights_dir=tmp_path / "weights", token=CONTROL_TOKEN, **options)


def stop_ids() -> tuple[int, ...]:
    from milestream.infra.model import stop_token_ids

    return stop_token_ids(load_tokenizer(MODEL))


def prompt_ids() -> tuple[int, ...]:
    return tuple(chat_input_ids(load_tokenizer(MODEL), [{"role": "user", "content": "What is 3 + 4?"}], ""))


def nudged(scale: float = 1e-2) -> dict[str, torch.Tensor]:
    model = load_model(MODEL, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return {name: t + scale * torch.randn(t.shape, generator=generator) for name, t in trainable_state_dict(model).items()}


async def streamed(url: str, rid: str) -> AsyncIterator[dict]:
    """The chunks of one long streamed request (no stop: LONG tokens) with the version span of each token."""
    body = {"request_id": rid, "token_ids": list(prompt_ids()), "model": SERVED_NAME, "stream": True,
            "sampling_params": {"max_tokens": LONG, "temperature": 1.0, "ignore_eos": True, "logprobs": 0,
                                "detokenize": False}}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/inference/v1/generate", json=body,
                             headers={"Authorization": f"Bearer {CONTROL_TOKEN}"}) as reply:
            assert reply.status == 200, await reply.text()
            async for line in reply.content:
                if line.startswith(b"data: {"):
                    yield json.loads(line[6:])


def test_token_ids_in_ids_logprobs_and_versions_out_for_every_sample(server: VllmServer, tmp_path: Path) -> None:
    policy = load_model(MODEL, dtype=torch.float32)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, stop_token_ids=stop_ids())
    prompt = prompt_ids()

    async def group():
        vllm = engine(server, tmp_path)
        try:
            return await asyncio.gather(*(vllm.generate(GenerateRequest(f"g/{i}", prompt, sampling)) for i in range(4)))
        finally:
            await vllm.close()

    results = asyncio.run(group())
    assert [r.request_id for r in results] == [f"g/{i}" for i in range(4)]
    for result in results:
        assert 0 < len(result.output_ids) <= 8 and result.finish_reason in ("stop", "length")
        assert result.versions == (0,) * len(result.output_ids)
        # the rollout log-prob is log_softmax(logits / temperature) of the served policy: the trainer's within bf16
        ids = torch.tensor([prompt + result.output_ids])
        with torch.no_grad():
            logits = policy(ids).logits[0, len(prompt) - 1:-1] / sampling.temperature
        trainer = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert all(math.isfinite(x) and x <= 0 for x in result.logprobs)
        assert (trainer - torch.tensor(result.logprobs)).abs().mean() < 0.1


def test_a_version_is_loaded_labelled_and_verified_by_vllms_checksums(server: VllmServer, tmp_path: Path) -> None:
    tensors = nudged()

    async def update():
        vllm = engine(server, tmp_path)
        try:
            await vllm.update_weights(1, tensors)
            result = await vllm.generate(GenerateRequest("v/0", prompt_ids(), SamplingParams(4, 1.0)))
            with pytest.raises(WeightVerificationError, match="weight_checker"):
                await vllm._verify(1, {"dp0:pp0:pcp0:tp0:model.norm.weight": "0" * 64})
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url + "/weight_info") as reply:
                    return vllm, result, await reply.json()
        finally:
            await vllm.close()

    vllm, result, info = asyncio.run(update())
    assert vllm.version == 1 and vllm.verified_updates == 1 and info == {"weight_version": "1"}
    assert result.versions == (1,) * len(result.output_ids)
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v000001"]


async def served_label(url: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/weight_info") as reply:
            return (await reply.json())["weight_version"]


@pytest.mark.parametrize("inflight", ["keep", "abort"])
def test_a_request_in_flight_is_kept_or_aborted_across_an_update(server: VllmServer, tmp_path: Path,
                                                                  inflight: str) -> None:
    version = {"keep": 2, "abort": 3}[inflight]
    rid = f"inflight-{inflight}"

    async def across():
        before = await served_label(server.url)
        vllm = engine(server, tmp_path, inflight=inflight, initial_version=version - 1)
        chunks = streamed(server.url, rid)
        seen = [await anext(chunks)]  # generating
        # frozen in the server by construction (a machine fast enough could otherwise finish it while the
        # update is prepared); the update's own pause then aborts it or keeps it, and its resume goes on
        await vllm._call("/pause?mode=keep", {})
        await vllm.update_weights(version, nudged(1e-3 * version))
        async for chunk in chunks:  # kept, it runs to its length (/abort_requests knows vLLM's own ids only)
            seen.append(chunk)
        await vllm.close()
        return before, seen

    before, chunks = asyncio.run(across())
    last = chunks[-1]["choices"][0]
    generated = sum(len(c["choices"][0]["token_ids"] or []) for c in chunks)
    if inflight == "keep":
        assert last["finish_reason"] == "length" and generated == LONG
    else:
        assert last["finish_reason"] == "abort" and generated < LONG
    spans = [span["version"] for span in last["weight_versions"]]
    # kept: the tokens before the update are the old version's, those after the new one's; aborted: none after
    assert spans == ([before, str(version)] if inflight == "keep" else [before])


def test_a_lora_version_reaches_vllm_merged_and_verified(server: VllmServer, tmp_path: Path) -> None:
    lora = MODEL.model_copy(update={"lora_rank": 4})
    adapters = {name: 0.05 * torch.randn_like(t) for name, t in trainable_state_dict(load_model(lora, dtype=torch.float32)).items()}

    async def update():
        vllm = engine(server, tmp_path, model=lora, initial_version=3)
        try:
            await vllm.update_weights(4, adapters)
            return vllm
        finally:
            await vllm.close()

    vllm = asyncio.run(update())
    assert vllm.version == 4 and vllm.verified_updates == 1


@pytest.mark.timeout(1800)  # the server starts again in the test: minutes on a loaded 2-core machine
def test_a_server_killed_comes_back_on_the_version_it_held(server: VllmServer, tmp_path: Path) -> None:
    """SIGKILLed and started again from its model folder (the initial weights), the server is given the
    version it held before a request is answered: the request sent while it was down waits for it."""
    async def killed():
        vllm = engine(server, tmp_path, initial_version=4)
        try:
            await vllm.update_weights(5, nudged(5e-3))
            await asyncio.to_thread(server.kill_and_start)
            return await vllm.generate(GenerateRequest("k/1", prompt_ids(), SamplingParams(4, 1.0)))
        finally:
            await vllm.close()

    after = asyncio.run(killed())
    assert after.versions == (5,) * len(after.output_ids)  # given back version 5, not its model folder's weights
