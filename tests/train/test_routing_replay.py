"""Routing replay (R3) on the tiny MoE: the engine records the experts of every token it feeds, per
row, through batching, left padding, KV caching and retraction; the trainer replaying them routes
exactly as the rollout did, and without replay a slightly moved router routes some token otherwise."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch import nn

from milestream.config import Config, ModelConfig, RolloutConfig
from milestream.train.learner import CollectedGroup, Learner
from milestream.infra.model import load_model, trainable_state_dict
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams
from milestream.engines.moe_routing import routing_records
from milestream.schemas import routing as wire
from milestream.schemas.records import GroupSample

MOE = ModelConfig(name="tiny-moe", dtype="float32", lora_rank=0, seed=3)
PROMPT = (1, 17, 230, 4051, 9, 77, 12)
GROUP = 4


def generate(engine: CpuEngine, prompts: Sequence[tuple[int, ...]], max_new_tokens: int) -> list[GenerateResult]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)

    async def run() -> list[GenerateResult]:
        return list(await asyncio.gather(*(engine.generate(GenerateRequest(f"r{i}", p, sampling))
                                           for i, p in enumerate(prompts))))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine() -> Iterator[CpuEngine]:
    engine = CpuEngine(MOE, RolloutConfig(max_batch=8), seed=5)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def group(engine: CpuEngine) -> list[GenerateResult]:
    return generate(engine, [PROMPT] * GROUP, max_new_tokens=8)


@contextmanager
def experts_used(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """The expert ids each MoE layer's experts actually received, per forward: [[layer ids [tokens, k]]]."""
    calls: list[list[torch.Tensor]] = []
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]

    def hook(layer: int):
        def keep(module: nn.Module, args: tuple) -> None:
            if layer == 0:
                calls.append([])
            calls[-1].append(args[1].detach().clone())
        return keep

    handles = [block.experts.register_forward_pre_hook(hook(i)) for i, block in enumerate(blocks)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def per_sample(calls: list[list[torch.Tensor]], prompt_len: int, lengths: Sequence[int]) -> list[np.ndarray]:
    """Each sample's sorted [prompt + response - 1, layers, k] from a shared-prompt forward's two passes."""
    prompt = torch.stack(calls[0], dim=1).numpy()  # [prompt, layers, k]
    rest = torch.stack(calls[1], dim=1).numpy().reshape(len(lengths), -1, prompt.shape[1], prompt.shape[2])
    return [np.sort(np.concatenate([prompt, rest[i, :n - 1]]), axis=2) for i, n in enumerate(lengths)]


def full_forward_routing(model: nn.Module, tokens: Sequence[int]) -> np.ndarray:
    with torch.no_grad(), experts_used(model) as calls:
        model(input_ids=torch.tensor([list(tokens)]))
    return np.sort(torch.stack(calls[0], dim=1).numpy(), axis=2)


def samples_of(results: Sequence[GenerateResult], prompt: Sequence[int]) -> list[GroupSample]:
    """The group as the trainer gets it from buffer.groups: routing packed, chunked and joined."""
    samples = []
    for i, result in enumerate(results):
        chunks = routing_records(f"g/{i}", "g", i, len(results), result.routing)
        n = len(result.output_ids)
        samples.append(GroupSample(f"g/{i}", "g", "p", i, len(results), list(prompt), list(result.output_ids),
                                   [1] * n, list(result.versions), 1.0 if i % 2 else 0.0, "truncated", "", "e", "w",
                                   0.0, 0.0, len(chunks), logprobs=list(result.logprobs),
                                   **wire.joined_fields(chunks)))
    return samples


def learner(replay: bool) -> Learner:
    cfg = Config().with_overrides(model=MOE.model_dump(), trainer={"routing_replay": replay, "lr": 1e-3},
                                  rollout={"temperature": 1.0})
    return Learner(cfg)


def trainer_pass(learn: Learner, samples: Sequence[GroupSample]) -> tuple[torch.Tensor, list[np.ndarray]]:
    """The trainer's forward of the loss on one group: log-probs and the experts it used per sample."""
    replay = learn._routing(samples)
    with torch.no_grad(), experts_used(learn.backend.model) as calls:
        logp = learn.backend.logprobs(samples[0].prompt_ids, [s.response_ids for s in samples], 1.0, **replay)
    return logp, per_sample(calls, len(samples[0].prompt_ids), [len(s.response_ids) for s in samples])


def nudge_nearest_tie(model: nn.Module, prompt: Sequence[int]) -> float:
    """Moves one row of layer 0's router, as a small training step might, just enough that the prompt
    token whose k-th and (k+1)-th experts are closest swaps them; the relative size of the change."""
    gate = model.model.layers[0].mlp.gate
    inputs: list[torch.Tensor] = []
    handle = gate.register_forward_hook(lambda module, args, output: inputs.append(args[0].detach()))
    with torch.no_grad():
        model(input_ids=torch.tensor([list(prompt)]))
    handle.remove()
    hidden = inputs[0].reshape(-1, gate.hidden_dim)
    logits = hidden @ gate.weight.detach().T
    ranked = logits.sort(dim=-1, descending=True)
    margins = ranked.values[:, gate.top_k - 1] - ranked.values[:, gate.top_k]
    token = int(margins.argmin())
    runner_up = int(ranked.indices[token, gate.top_k])
    h = hidden[token]
    delta = (margins[token] + 0.05) * h / h.dot(h)
    with torch.no_grad():
        gate.weight[runner_up] += delta
    return float(delta.norm() / gate.weight.detach().norm())


def test_the_engine_records_every_fed_token_of_each_row_as_one_full_forward_routes_it(engine: CpuEngine) -> None:
    # rows of different lengths share the batch (left padding), two share a prompt (one prefill, copied)
    prompts = [PROMPT, PROMPT, (5, 6), (900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910)]
    results = generate(engine, prompts, max_new_tokens=6)
    for prompt, result in zip(prompts, results):
        recorded = result.routing.expert_ids
        assert result.routing.num_experts == 8
        assert recorded.shape == (len(prompt) + len(result.output_ids) - 1, 2, 2)
        expected = full_forward_routing(engine.model, prompt + result.output_ids[:-1])
        assert np.array_equal(np.sort(recorded, axis=2), expected)


def test_a_retracted_row_keeps_the_routing_of_its_prefill_on_the_new_weights(engine: CpuEngine) -> None:
    retracting = CpuEngine(MOE, RolloutConfig(), seed=5, inflight="retract")
    torch.manual_seed(11)
    update = {n: t + 0.3 * torch.randn(t.shape) for n, t in trainable_state_dict(retracting.model).items()}
    sampling = SamplingParams(max_new_tokens=100, temperature=1.0)

    async def run() -> GenerateResult:
        long = asyncio.create_task(retracting.generate(GenerateRequest("long", PROMPT, sampling)))
        await retracting.generate(GenerateRequest("short", PROMPT, SamplingParams(3, 1.0)))
        await retracting.update_weights(1, update)
        return await long

    try:
        result = asyncio.run(run())
        switch = result.versions.index(1)
        assert 3 <= switch < 100  # the update landed mid-generation
        expected = full_forward_routing(retracting.model, PROMPT + result.output_ids[:-1])
        assert np.array_equal(np.sort(result.routing.expert_ids, axis=2), expected)
    finally:
        asyncio.run(retracting.close())


def test_the_trainer_replaying_routes_as_the_rollout_and_matches_its_logprobs(group: list[GenerateResult]) -> None:
    samples = samples_of(group, PROMPT)
    logp, used = trainer_pass(learner(replay=True), samples)
    for sample, result, ids in zip(samples, group, used):
        assert np.array_equal(ids, np.sort(result.routing.expert_ids, axis=2))  # every token, every layer
        assert np.array_equal(wire.expert_ids(sample), ids)
    engine_logp = torch.tensor([r.logprobs for r in group])
    torch.testing.assert_close(logp, engine_logp, atol=1e-5, rtol=0)


def test_after_a_small_router_change_only_replay_keeps_the_rollout_routing(group: list[GenerateResult]) -> None:
    samples = samples_of(group, PROMPT)
    recorded = [np.sort(r.routing.expert_ids, axis=2) for r in group]
    replaying, own = learner(replay=True), learner(replay=False)
    size = nudge_nearest_tie(replaying.backend.model, PROMPT)
    nudge_nearest_tie(own.backend.model, PROMPT)
    assert size < 0.05  # a step-sized change of one router
    replay_logp, replayed = trainer_pass(replaying, samples)
    own_logp, recomputed = trainer_pass(own, samples)
    assert all(np.array_equal(ids, expected) for ids, expected in zip(replayed, recorded))
    differs = [np.argwhere((ids != expected).any(axis=2)) for ids, expected in zip(recomputed, recorded)]
    assert all(len(d) > 0 for d in differs)  # the nudged prompt token, in every sample: [token, layer] pairs
    assert all(0 in d[:, 1] for d in differs)
    assert not torch.equal(replay_logp, own_logp)


def test_a_training_step_replays_and_rejects_routing_that_does_not_fit(group: list[GenerateResult]) -> None:
    samples = samples_of(group, PROMPT)
    learn = learner(replay=True)
    with experts_used(learn.backend.model) as calls:
        figures = learn.train_step([CollectedGroup("g", samples, staleness=0)])
    assert np.isfinite(figures["loss"]) and figures["grad_norm"] > 0
    assert per_sample(calls, len(PROMPT), [len(s.response_ids) for s in samples])[0].tolist() == \
        np.sort(group[0].routing.expert_ids, axis=2).tolist()
    short = samples_of([group[0]], PROMPT[:-1])  # a prompt one token shorter than its routing
    with pytest.raises(ValueError, match="g/0: field routing_layout holds"):
        learn.train_step([CollectedGroup("g", short, staleness=0)])


def test_routing_of_the_first_wire_layout_still_decodes() -> None:
    ids = np.random.default_rng(1).integers(0, 300, size=(9, 3, 4))
    plain = wire.zstandard.ZstdCompressor().compress(ids.astype("<u2").tobytes())
    assert np.array_equal(wire.unpack([9, 3, 4, 2], wire.PLAIN_COMPRESSION, [plain]), ids)
    with pytest.raises(ValueError, match="unknown routing compression"):
        wire.unpack([9, 3, 4, 2], "lz4", [plain])


def test_a_dense_model_records_no_routing() -> None:
    dense = load_model(ModelConfig(name="tiny-random", lora_rank=0), dtype=torch.float32)
    assert not [m for m in dense.modules() if type(m).__name__.endswith("TopKRouter")]
    assert routing_records("t", "g", 0, 1, None) == []
