"""The model families the README names, each a tiny random model of its real configuration's shape
(tests/model_folders.py FAMILIES: sliding-window and full-attention layers where the family mixes them,
grouped-query attention with head_dim != hidden / heads, tied or untied embeddings, soft-capped logits,
its chat template and end-of-turn token), through every stage a run takes it: the CPU engine generates
groups of 8 from chat prompts of mixed lengths that pass the sliding window, joining a running batch; the
trainer's log-probs match the engine's and a step trains on them; the trained weights land mid-generation;
the version exports to a folder transformers reloads. What a family cannot do is refused before any stage
starts (producers/inputs.py check_model), naming what it lacks."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from holds import Holds, update_mid_generation
from model_folders import WINDOW, FAMILIES, STYLES, family_folder
from transformers import AutoModelForCausalLM, AutoTokenizer, Llama4TextConfig, Qwen3NextConfig

from milestream.config import Config
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams, sampling_params
from milestream.infra.model import (EOS_TOKEN, ModelFolderError, end_of_turn_token, load_tokenizer,
                                    load_trainable_state_dict)
from milestream.producers.inputs import check_model
from milestream.producers.sessions.templates import chat_template
from milestream.producers.tasks import chat_input_ids
from milestream.schemas.records import GroupSample
from milestream.streams.weights.base import weights_dir
from milestream.streams.weights.disk import write_full
from milestream.train.export import export_version
from milestream.train.learner import CollectedGroup, Learner

QUESTIONS = ("Hi", "What is 17 times 23?",
             "A farmer has 17 sheep, all but nine run away, then he buys twice as many as remain. How many now?")
LENGTHS = (3, 14, 7, 11, 5, 12, 9, 13)  # max_new_tokens of a group's 8 samples: rows leave at different steps
LONG = 10
AT_STEP = 3  # the update lands between the engine's 3rd and 4th steps
ATOL = 1e-4  # fp32: a cached, left-padded decode against the trainer's shared-prompt forward


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: family_folder(root / family, family) for family in FAMILIES}


def run_config(folder: Path, run_dir: Path, **rollout) -> Config:
    return Config().with_overrides(model={"path": str(folder), "lora_rank": 0, "dtype": "float32", "seed": 3},
                                   rollout=rollout, trainer={"lr": 1e-2, "batch_groups": 1},
                                   run={"run_dir": str(run_dir)})


def group_requests(prompt: tuple[int, ...], name: str, temperature: float,
                   stop_token_ids: tuple[int, ...]) -> list[GenerateRequest]:
    return [GenerateRequest(f"{name}/{i}", prompt, SamplingParams(n, temperature, stop_token_ids))
            for i, n in enumerate(LENGTHS)]


def generate_groups(engine: CpuEngine, groups: list[list[GenerateRequest]]) -> list[list[GenerateResult]]:
    """The first group alone, the others joining the running batch once one of its rows has left."""

    async def run() -> list[list[GenerateResult]]:
        first = [asyncio.create_task(engine.generate(r)) for r in groups[0]]
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        later = [asyncio.gather(*(engine.generate(r) for r in group)) for group in groups[1:]]
        return [list(await asyncio.gather(*first)), *await asyncio.gather(*later)]

    return asyncio.run(run())


def trainer_logprobs(learner: Learner, requests: list[GenerateRequest], results: list[GenerateResult]) -> list:
    """Each result's log-probs as the trainer computes them, the group (one prompt) in one forward."""
    logp = learner.backend.logprobs(list(requests[0].input_ids), [list(r.output_ids) for r in results],
                                    requests[0].sampling.temperature).detach()
    return [row[:len(result.output_ids)] for row, result in zip(logp, results)]


def assert_trainer_agrees(learner: Learner, requests: list[GenerateRequest], results: list[GenerateResult],
                          tokens: slice = slice(None)) -> None:
    for req, result, expected in zip(requests, results, trainer_logprobs(learner, requests, results)):
        torch.testing.assert_close(torch.tensor(result.logprobs[tokens]), expected[tokens], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{req.request_id}: {m}")


def collected(requests: list[GenerateRequest], results: list[GenerateResult]) -> CollectedGroup:
    prompt = list(requests[0].input_ids)
    samples = [GroupSample(f"g/{i}", "g", "p", i, len(results), prompt, list(r.output_ids), [1] * len(r.output_ids),
                           list(r.versions), float(i % 2), "truncated", "", "e", "w", 0.0, 0.0,
                           logprobs=list(r.logprobs)) for i, r in enumerate(results)]
    return CollectedGroup("g", samples, staleness=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_generates_trains_updates_mid_generation_and_exports(family: str, folders: dict[str, Path],
                                                                     tmp_path: Path, holds: Holds) -> None:
    folder = folders[family]
    cfg = run_config(folder, tmp_path / "run")
    check_model(cfg)  # served: nothing refused
    tokenizer = load_tokenizer(cfg.model)
    end_of_turn = STYLES[FAMILIES[family].style][4] if FAMILIES[family].style in STYLES else EOS_TOKEN
    sampling = sampling_params(cfg.rollout, tokenizer)
    assert end_of_turn_token(tokenizer) == end_of_turn
    stop = tokenizer.convert_tokens_to_ids(end_of_turn)
    assert sampling.stop_token_ids[0] == chat_template(tokenizer).end_of_turn_id == stop  # sessions end turns there
    prompts = [tuple(chat_input_ids(tokenizer, [{"role": "user", "content": q}], "")) for q in QUESTIONS]
    assert len(prompts[-1]) > WINDOW and len(set(map(len, prompts))) == len(prompts)
    groups = [group_requests(prompt, f"g{i}", temperature, sampling.stop_token_ids)
              for i, (prompt, temperature) in enumerate(zip(prompts, (1.0, 0.7, 1.0)))]
    engine = CpuEngine(cfg.model, cfg.rollout, seed=5)
    learner = Learner(cfg)
    try:
        # generate: 24 rows of 3 prompt lengths, every one a whole group, its log-probs the trainer's
        results = generate_groups(engine, groups)
        for requests, group in zip(groups, results):
            assert [r.finish_reason for r in group] == ["length" if len(r.output_ids) == q.sampling.max_new_tokens
                                                        else "stop" for q, r in zip(requests, group)]
            assert_trainer_agrees(learner, requests, group)
        # train a step on a group, then land the trained weights while 8 rows decode (retracted, re-prefilled)
        old = {name: t.clone() for name, t in learner.export_weights().items()}
        figures = learner.train_step([collected(groups[2], results[2])])
        assert 0 < figures["grad_norm"] < float("inf")
        trained = {name: t.clone() for name, t in learner.export_weights().items()}
        updating = [GenerateRequest(f"u/{i}", prompts[i % 3], SamplingParams(LONG, 1.0)) for i in range(8)]
        mixed = update_mid_generation(engine, updating, trained, holds, AT_STEP)
        for result in mixed:
            assert result.versions == (0,) * AT_STEP + (1,) * (LONG - AT_STEP)
        for i in range(3):
            assert_trainer_agrees(learner, updating[i::3], mixed[i::3], slice(AT_STEP, None))
        load_trainable_state_dict(learner.backend.model, old)
        for i in range(3):
            assert_trainer_agrees(learner, updating[i::3], mixed[i::3], slice(None, AT_STEP))
        load_trainable_state_dict(learner.backend.model, trained)
    finally:
        asyncio.run(engine.close())
    # export: the trained version, reloaded by plain transformers, computes the trainer's logits
    write_full(weights_dir(cfg.run.run_dir), 1, 1, trained)
    export_version(cfg, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    probe = torch.tensor([prompts[-1]])
    with torch.no_grad():
        assert torch.equal(reloaded(probe).logits, learner.backend.model(probe).logits)
    shape = [{k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
             for config in (reloaded.config, learner.backend.model.config)]
    assert shape[0] == shape[1]  # layer types, window, head_dim, soft-capping, tied embeddings
    assert end_of_turn_token(AutoTokenizer.from_pretrained(tmp_path / "out")) == end_of_turn


def test_gemma3_under_true_on_policy_is_exact_within_its_window_and_refused_past_it(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """Exact attention gives a query every key from its row's first: a sliding window shorter than the
    longest sequence is refused before any stage starts, naming the window; within it, bit for bit."""
    past = run_config(folders["gemma3"], tmp_path / "run", true_on_policy=True)
    refused = f"rollout.true_on_policy: model.path .* \\(gemma3_text\\) has sliding-window layers that attend over " \
              f"the last {WINDOW} tokens only, fewer than rollout.max_context_tokens \\(1024\\).*at most {WINDOW}"
    with pytest.raises(ModelFolderError, match=refused):
        check_model(past)
    with pytest.raises(ValueError, match="Gemma3ForCausalLM has sliding-window layers"):
        CpuEngine(past.model, past.rollout)
    within = run_config(folders["gemma3"], tmp_path / "run", true_on_policy=True, max_context_tokens=WINDOW)
    check_model(within)
    engine = CpuEngine(within.model, within.rollout, seed=5)
    prompts = [(2, 300, 41), (2, 17, 230, 4051, 9, 77, 12, 500)]
    groups = [[GenerateRequest(f"{i}/{j}", prompt, SamplingParams(WINDOW - len(prompt) - j, 1.0)) for j in range(4)]
              for i, prompt in enumerate(prompts)]
    try:
        results = generate_groups(engine, groups)
    finally:
        asyncio.run(engine.close())
    learner = Learner(within)
    for requests, group in zip(groups, results):
        for result, expected in zip(group, trainer_logprobs(learner, requests, group)):
            assert list(result.logprobs) == expected.tolist()


def test_gemma2_under_true_on_policy_is_refused_for_its_capped_attention_logits(folders: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    cfg = run_config(folders["gemma2"], tmp_path / "run", true_on_policy=True)
    with pytest.raises(ModelFolderError, match=r"\(gemma2\) caps its attention logits"):
        check_model(cfg)


@pytest.mark.parametrize("config, layers", [
    (Llama4TextConfig(num_hidden_layers=4), "chunked_attention"),
    (Qwen3NextConfig(num_hidden_layers=4), "linear_attention"),
])
def test_a_family_the_cpu_engine_cannot_batch_is_refused_naming_its_layers(
        config, layers: str, folders: dict[str, Path], tmp_path: Path) -> None:
    folder = shutil.copytree(folders["llama"], tmp_path / config.model_type)
    config.save_pretrained(folder)  # what check_model reads; the weights are never loaded
    cfg = run_config(folder, tmp_path / "run")
    with pytest.raises(ModelFolderError, match=f"\\({config.model_type}\\) has {layers} layers, which the CPU engine "
                                               "does not batch .* rollout.engine_url"):
        check_model(cfg)
    check_model(cfg.with_overrides(rollout={"engine_url": "http://127.0.0.1:1"}))  # another engine's to serve
