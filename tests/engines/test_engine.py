"""CpuEngine on the tiny random model: recorded log-probs, batching, versions, pause and close."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from milestream.config import ModelConfig
from milestream.infra.model import load_model, trainable_state_dict
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams

from holds import Holds

MakeEngine = Callable[..., CpuEngine]


def request(
    request_id: str, prompt: tuple[int, ...], max_new_tokens: int, temperature: float = 1.0
) -> GenerateRequest:
    return GenerateRequest(request_id, prompt, SamplingParams(max_new_tokens, temperature))


def reference_logprobs(engine: CpuEngine, req: GenerateRequest, result: GenerateResult) -> torch.Tensor:
    """Log-probs of the sampled tokens from one fresh, unpadded forward over prompt + output."""
    ids = torch.tensor([list(req.input_ids) + list(result.output_ids)])
    with torch.inference_mode():
        logits = engine.model(input_ids=ids).logits[0].float()
    temperature = req.sampling.temperature or 1.0
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(req.input_ids) - 1
    return logp[start:-1].gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0]


def assert_faithful(engine: CpuEngine, req: GenerateRequest, result: GenerateResult) -> None:
    assert result.request_id == req.request_id
    assert len(result.output_ids) == len(result.logprobs) == len(result.versions)
    expected = reference_logprobs(engine, req, result)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def test_logprobs_match_a_fresh_forward_with_mixed_prompts(make_engine: MakeEngine) -> None:
    engine = make_engine()
    # Different lengths (left padding), a prompt shared by two rows (KV copy), two temperatures,
    # and requests that join the running batch later (merge, then trimming of dead padding).
    first = [
        request("a", (1, 2, 3, 4, 5, 6, 7), 6),
        request("b", (9, 8, 7), 20, temperature=0.7),
        request("c", (1, 2, 3, 4, 5, 6, 7), 12),
        request("d", tuple(range(100, 120)), 9, temperature=1.3),
    ]
    late = [request("e", (42,), 15), request("f", tuple(range(200, 240)), 5)]

    async def run() -> list[GenerateResult]:
        tasks = [asyncio.create_task(engine.generate(r)) for r in first]
        done = await tasks[0]
        late_tasks = [asyncio.create_task(engine.generate(r)) for r in late]
        return [done] + list(await asyncio.gather(*tasks[1:], *late_tasks))

    results = asyncio.run(run())
    for req, result in zip(first + late, results):
        assert result.finish_reason == "length"
        assert len(result.output_ids) == req.sampling.max_new_tokens
        assert_faithful(engine, req, result)


def test_rows_that_finish_early_are_returned_before_the_batch_ends(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def run() -> None:
        long = asyncio.create_task(engine.generate(request("long", (5, 6, 7), 120)))
        short = await engine.generate(request("short", (5, 6, 7), 2))
        assert len(short.output_ids) == 2
        assert not long.done()
        assert len((await long).output_ids) == 120

    asyncio.run(run())


def test_a_stop_token_ends_the_row_and_is_kept(make_engine: MakeEngine) -> None:
    engine = make_engine()
    prompt = (11, 12, 13)
    with torch.inference_mode():
        greedy_first = int(engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
    req = GenerateRequest("s", prompt, SamplingParams(50, 0.0, stop_token_ids=(greedy_first,)))
    result = asyncio.run(engine.generate(req))
    assert result.finish_reason == "stop"
    assert result.output_ids == (greedy_first,)
    assert_faithful(engine, req, result)


def test_every_token_records_the_version_that_produced_it(make_engine: MakeEngine, tiny_cfg: ModelConfig) -> None:
    lora_cfg = tiny_cfg.model_copy(update={"lora_rank": 4})
    engine = make_engine(lora_cfg)
    trainer = load_model(lora_cfg, dtype=torch.float32)
    update = {name: torch.randn(t.shape) * 0.5 for name, t in trainable_state_dict(trainer).items()}

    async def run() -> GenerateResult:
        long = asyncio.create_task(engine.generate(request("long", (3, 4, 5), 120)))
        await engine.generate(request("short", (3, 4, 5), 3))
        await engine.pause()
        await engine.update_weights(1, update)
        await engine.resume()
        return await long

    result = asyncio.run(run())
    switch = result.versions.index(1)
    assert 3 <= switch < 120
    assert result.versions == (0,) * switch + (1,) * (120 - switch)
    assert engine.version == 1
    for name, tensor in trainable_state_dict(engine.model).items():
        torch.testing.assert_close(tensor, update[name])
    with pytest.raises(ValueError, match="older"):
        asyncio.run(engine.update_weights(0, update))


def test_updated_weights_drive_new_requests(make_engine: MakeEngine) -> None:
    """After an update, a new request's log-probs are those of the updated model."""
    engine = make_engine()
    update = {name: t + 0.05 * torch.randn(t.shape) for name, t in trainable_state_dict(engine.model).items()}
    req = request("x", (7, 8, 9, 10), 8)

    async def run() -> GenerateResult:
        await engine.update_weights(5, update)
        return await engine.generate(req)

    result = asyncio.run(run())
    assert result.versions == (5,) * 8
    assert_faithful(engine, req, result)


def test_pause_holds_new_steps_until_resume(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def run() -> None:
        await engine.pause()
        task = asyncio.create_task(engine.generate(request("p", (1, 2), 4)))
        await asyncio.sleep(0.2)
        assert not task.done()
        await engine.resume()
        assert (await task).finish_reason == "length"

    asyncio.run(run())


def test_close_aborts_requests_in_flight(make_engine: MakeEngine, holds: Holds) -> None:
    engine = make_engine()

    async def run() -> GenerateResult:
        holds.arm("engine.stepped")
        task = asyncio.create_task(engine.generate(request("c", (1, 2), 1000)))
        held_by = await asyncio.to_thread(holds.wait_held, "engine.stepped", 120)  # its first token out
        await engine.pause()  # no step runs between the release and close
        holds.release("engine.stepped", held_by)
        await engine.close()
        return await task

    result = asyncio.run(run())
    assert result.finish_reason == "abort"
    assert len(result.output_ids) == 1
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(engine.generate(request("late", (1,), 1)))


def test_a_cancelled_request_leaves_the_others_running(make_engine: MakeEngine) -> None:
    engine = make_engine()

    async def run() -> GenerateResult:
        doomed = asyncio.create_task(engine.generate(request("doomed", (4, 4), 1000)))
        kept = asyncio.create_task(engine.generate(request("kept", (5, 5, 5), 30)))
        await asyncio.sleep(0.02)
        doomed.cancel()
        return await kept

    result = asyncio.run(run())
    assert len(result.output_ids) == 30
    assert_faithful(engine, request("kept", (5, 5, 5), 30), result)


def test_bf16_engine_samples_valid_tokens(make_engine: MakeEngine) -> None:
    cfg = ModelConfig(name="tiny-random", dtype="bfloat16", lora_rank=8)
    engine = make_engine(cfg)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    results = asyncio.run(_gather(engine, [request(str(i), (1, 2, 3), 5) for i in range(4)]))
    for result in results:
        assert all(0 <= t < engine.model.config.vocab_size for t in result.output_ids)
        assert all(lp <= 0 for lp in result.logprobs)


async def _gather(engine: CpuEngine, requests: list[GenerateRequest]) -> list[GenerateResult]:
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))
