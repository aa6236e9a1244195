"""What happens to requests in flight when a weight version lands (weights.inflight), on the
CpuEngine with the tiny model: abort ends them, keep lets them go on in place over the old KV
cache, retract re-prefills them on the new weights and resumes. Tokens keep their version."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

import torch

from holds import Holds, update_mid_generation
from test_engine import reference_logprobs, request

from milestream.config import ModelConfig
from milestream.infra.model import load_model, trainable_state_dict
from milestream.engines.engine import CpuEngine, GenerateResult
from milestream.producers.worker import STATUS

MakeEngine = Callable[..., CpuEngine]
PROMPTS = {"a": (3, 4, 5), "b": (3, 4, 5), "c": (9, 8, 7, 6, 5, 4)}  # a and b share a prompt
LONG = 24
AT_STEP = 3  # the update lands between the engine's 3rd and 4th steps: every request then holds 3 tokens


def long_requests() -> list:
    return [request(rid, prompt, LONG, temperature=1.0) for rid, prompt in PROMPTS.items()]


def new_weights(engine: CpuEngine) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {name: t + 0.5 * torch.randn(t.shape) for name, t in trainable_state_dict(engine.model).items()}


def split(result: GenerateResult) -> int:
    """Where version 1 starts; asserts the versions are 0 then 1, nothing else, switching at AT_STEP."""
    switch = result.versions.index(1)
    assert result.versions == (0,) * switch + (1,) * (len(result.versions) - switch)
    assert switch == AT_STEP
    return switch


def test_abort_ends_requests_in_flight_as_aborted(make_engine: MakeEngine, holds: Holds) -> None:
    engine = make_engine(inflight="abort")
    results = update_mid_generation(engine, long_requests(), new_weights(engine), holds, AT_STEP)
    for result in results:
        assert result.finish_reason == "abort" and STATUS[result.finish_reason] == "aborted"
        assert len(result.output_ids) == AT_STEP
        assert set(result.versions) == {0}  # nothing was generated on the new weights
    after = asyncio.run(engine.generate(request("after", PROMPTS["a"], 4)))
    assert after.finish_reason == "length" and after.versions == (1,) * 4


def test_keep_continues_in_place_with_mixed_versions(make_engine: MakeEngine, holds: Holds) -> None:
    engine = make_engine(inflight="keep")
    results = update_mid_generation(engine, long_requests(), new_weights(engine), holds, AT_STEP)
    stale = 0
    for rid, result in zip(PROMPTS, results):
        assert result.finish_reason == "length" and len(result.output_ids) == LONG
        switch = split(result)
        # the new weights attend over a KV cache the old weights computed: not what a fresh
        # forward of the new model gives (which is what retract restores)
        fresh = reference_logprobs(engine, request(rid, PROMPTS[rid], LONG), result)
        stale += not torch.allclose(torch.tensor(result.logprobs[switch:]), fresh[switch:], atol=1e-4)
    assert stale == len(results)


def test_retract_resumes_on_the_new_weights_with_versions_split_at_the_update(
        make_engine: MakeEngine, tiny_cfg: ModelConfig, holds: Holds) -> None:
    engine = make_engine(inflight="retract")
    old = SimpleNamespace(model=load_model(tiny_cfg, dtype=torch.float32))  # the engine's version-0 weights
    results = update_mid_generation(engine, long_requests(), new_weights(engine), holds, AT_STEP)
    for rid, result in zip(PROMPTS, results):
        assert result.finish_reason == "length" and len(result.output_ids) == LONG
        switch = split(result)
        req = request(rid, PROMPTS[rid], LONG)
        # tokens before the update are the old model's, those after the new model's over the
        # whole context (re-prefilled), each to 1e-3 (cached decoding against one full forward
        # rounds differently over the tokens; the two models differ by far more)
        torch.testing.assert_close(torch.tensor(result.logprobs[:switch]),
                                   reference_logprobs(old, req, result)[:switch], atol=1e-3, rtol=0)
        torch.testing.assert_close(torch.tensor(result.logprobs[switch:]),
                                   reference_logprobs(engine, req, result)[switch:], atol=1e-3, rtol=0)
    assert engine.update_pause_s > 0

