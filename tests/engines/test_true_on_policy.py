"""rollout.true_on_policy: every log-prob the CpuEngine records equals, bit for bit, the one the trainer
computes for that token (the local backend's shared-prompt forward, under the Learner), whatever the
engine's batch held: rows of other prompts and lengths (left padding), rows joining and leaving,
shared prefills, several batch sizes; in fp32 and bf16, on the tiny model and on SmolLM2; and across a
weight update landing mid-generation under each in-flight policy."""
from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch

from holds import Holds, update_mid_generation

from milestream.config import Config
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams
from milestream.infra.model import load_trainable_state_dict
from milestream.schemas.records import GroupSample
from milestream.train.learner import CollectedGroup, Learner

# tiny: full fine-tuning (an update rewrites every weight, the tied embedding too); SmolLM2: LoRA rank 16
MODELS = {
    "tiny-fp32": {"name": "tiny-random", "dtype": "float32", "lora_rank": 0, "seed": 3},
    "tiny-bf16": {"name": "tiny-random", "dtype": "bfloat16", "lora_rank": 0, "seed": 3},
    "smollm2-fp32": {"name": "smollm2-135m-instruct", "dtype": "float32"},
    "smollm2-bf16": {"name": "smollm2-135m-instruct", "dtype": "bfloat16"},
}
# prompt -> (temperature, max_new_tokens of each of its samples): 1 to 37 prompt tokens, groups of 1 to 4
GROUPS = {
    (42,): (1.0, (9, 3)),
    (1, 2, 3, 4, 5, 6, 7): (0.7, (6, 14, 2, 11)),
    tuple(range(100, 137)): (1.3, (12,)),
    (9, 8, 7): (1.0, (5, 16, 8)),
}
LONG = 10
AT_STEP = 3  # the update lands between the engine's 3rd and 4th steps


def config(model: str, **rollout) -> Config:
    return Config().with_overrides(model=MODELS[model], rollout={"true_on_policy": True, **rollout},
                                   trainer={"batch_groups": 1})


@pytest.fixture(autouse=True)
def one_thread():
    """As every stage computes (model.threads 1): on a shared machine more threads than free cores make
    MKL's fp32 wait on descheduled threads, seconds a step."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engines():
    made: list[CpuEngine] = []

    def make(cfg: Config, **kwargs) -> CpuEngine:
        made.append(CpuEngine(cfg.model, cfg.rollout, seed=5, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        asyncio.run(engine.close())


def requests(groups: dict) -> list[GenerateRequest]:
    return [GenerateRequest(f"{prompt[0]}/{len(prompt)}/{i}", prompt, SamplingParams(n, temperature))
            for prompt, (temperature, lengths) in groups.items() for i, n in enumerate(lengths)]


def by_prompt(reqs: Sequence[GenerateRequest], results: Sequence[GenerateResult]) -> dict:
    groups: dict[tuple[int, ...], list[tuple[GenerateRequest, GenerateResult]]] = defaultdict(list)
    for req, result in zip(reqs, results):
        groups[req.input_ids].append((req, result))
    return groups


def trainer_logprobs(learner: Learner, reqs: Sequence[GenerateRequest],
                     results: Sequence[GenerateResult]) -> dict[str, list[float]]:
    """The trainer's log-probs of every result, each group of a prompt in one forward as it trains it."""
    out = {}
    for prompt, pairs in by_prompt(reqs, results).items():
        logp = learner.backend.logprobs(list(prompt), [list(r.output_ids) for _, r in pairs],
                                        pairs[0][0].sampling.temperature)
        for row, (req, result) in zip(logp.detach(), pairs):
            out[req.request_id] = row[:len(result.output_ids)].tolist()
    return out


def run_bursts(engine: CpuEngine, reqs: Sequence[GenerateRequest]) -> list[GenerateResult]:
    """One request alone, then a burst while it runs, then the rest joining as the first ones finish:
    the batch grows, shrinks and mixes prompts of every length."""

    async def run() -> list[GenerateResult]:
        alone = await engine.generate(reqs[0])
        burst = [asyncio.create_task(engine.generate(r)) for r in reqs[1:6]]
        await asyncio.wait(burst, return_when=asyncio.FIRST_COMPLETED)
        late = [asyncio.create_task(engine.generate(r)) for r in reqs[6:]]
        return [alone, *await asyncio.gather(*burst, *late)]

    return asyncio.run(run())


@pytest.mark.parametrize("model", MODELS)
def test_every_rollout_logprob_equals_the_trainers(model: str, engines) -> None:
    cfg = config(model, max_batch=6)  # rows wait for room: the batch is refilled as rows leave
    engine = engines(cfg)
    reqs = requests(GROUPS)
    results = run_bursts(engine, reqs)
    expected = trainer_logprobs(Learner(cfg), reqs, results)
    for req, result in zip(reqs, results):
        assert len(result.output_ids) == req.sampling.max_new_tokens
        assert list(result.logprobs) == expected[req.request_id], req.request_id


def test_the_steps_logprob_diff_and_its_breakdown_are_zero_at_staleness_zero(engines) -> None:
    cfg = config("tiny-bf16")
    engine = engines(cfg)
    prompt = (1, 2, 3, 4, 5, 6, 7)
    reqs = requests({prompt: (1.0, (6, 14, 2, 11))})
    results = run_bursts(engine, reqs)
    samples = [GroupSample(f"g/{i}", "g", "p", i, len(results), list(prompt), list(r.output_ids),
                           [1] * len(r.output_ids), list(r.versions), float(i % 2), "truncated", "", "e", "w",
                           0.0, 0.0, logprobs=list(r.logprobs)) for i, r in enumerate(results)]
    figures = Learner(cfg).train_step([CollectedGroup("g", samples, staleness=0)])
    assert figures["logprob_diff"] == 0.0 and figures["kl_rollout_train"] == 0.0
    # and so is its every part: responses of at most 16 tokens, all of pi_old's version; no token offends
    breakdown = {name: value for name, value in figures.items() if name.startswith("logprob_diff_")}
    assert breakdown == {"logprob_diff_pos_0_15": 0.0, "logprob_diff_lag_0": 0.0}


def new_weights(learner: Learner) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    return {name: t + 0.05 * torch.randn(t.shape) for name, t in learner.export_weights().items()}


@pytest.mark.parametrize("inflight", ["abort", "keep", "retract"])
@pytest.mark.parametrize("model", MODELS)
def test_logprobs_stay_equal_across_a_weight_update(model: str, inflight: str, engines, holds: Holds) -> None:
    cfg = config(model)
    engine = engines(cfg, inflight=inflight)
    learner = Learner(cfg)
    reqs = requests({(3, 4, 5): (1.0, (LONG, LONG)), (9, 8, 7, 6, 5, 4, 2, 1, 99, 98, 97): (0.7, (LONG,))})
    update = new_weights(learner)
    results = update_mid_generation(engine, reqs, update, holds, AT_STEP)
    before = trainer_logprobs(learner, reqs, results)
    load_trainable_state_dict(learner.backend.model, update)
    after = trainer_logprobs(learner, reqs, results)
    for req, result in zip(reqs, results):
        switch = result.versions.index(1) if 1 in result.versions else len(result.versions)
        assert switch == AT_STEP
        assert list(result.logprobs[:switch]) == before[req.request_id][:switch]
        if inflight == "abort":
            assert result.finish_reason == "abort" and len(result.output_ids) == AT_STEP
        else:  # keep and retract: the tokens after the update are the new weights' over a fresh cache
            assert len(result.output_ids) == LONG and set(result.versions[switch:]) == {1}
            assert list(result.logprobs[switch:]) == after[req.request_id][switch:]
    fresh = requests({(3, 4, 5): (1.0, (5,))})
    again = asyncio.run(engine.generate(fresh[0]))
    assert again.versions == (1,) * 5
    assert list(again.logprobs) == trainer_logprobs(learner, fresh, [again])[fresh[0].request_id]


def test_the_engines_top_k_logprobs_are_the_trainers(engines) -> None:
    """rollout.logprobs_topk: each token's k likeliest ids with their log-probs, the distribution its
    own log-prob comes from; with true on-policy the trainer gives each candidate the same value."""
    cfg = config("tiny-bf16", logprobs_topk=4)
    engine = engines(cfg)
    prompt = (1, 2, 3, 4, 5, 6, 7)
    result = asyncio.run(engine.generate(GenerateRequest("r", prompt, SamplingParams(6, 0.7))))
    assert len(result.topk_ids) == len(result.topk_logprobs) == len(result.output_ids) == 6
    for token, logprob, ids, values in zip(result.output_ids, result.logprobs, result.topk_ids, result.topk_logprobs):
        assert len(ids) == len(set(ids)) == 4 and list(values) == sorted(values, reverse=True)
        assert logprob <= values[0] and (token not in ids or values[ids.index(token)] == logprob)
    # the trainer's log-prob of each candidate in its place: the response up to it, then the candidate
    rows = [list(result.output_ids[:t]) + [token] for t, ids in enumerate(result.topk_ids) for token in ids]
    logp = Learner(cfg).backend.logprobs(list(prompt), rows, 0.7).detach()
    assert [logp[i, len(row) - 1].item() for i, row in enumerate(rows)] == [
        value for values in result.topk_logprobs for value in values]
    plain = asyncio.run(engines(config("tiny-bf16")).generate(GenerateRequest("r", prompt, SamplingParams(6, 0.7))))
    assert plain.topk_ids == plain.topk_logprobs == ()  # not asked: not computed
