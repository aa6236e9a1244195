"""An agent's episode of several conversations and branches becomes every one of its leaves, on the log.

The agent (real ``openai`` client, scripted calculator policy) asks the calculator, then sends two different
tool results after the same first turn (a branch sharing that turn), then opens a second conversation (a
checker). All three leaves are the episode's trajectories: each token for token the engine's, with the
episode's reward, each generated token trained in one leaf only; through the worker and the broker they
complete one group, which the trainer's checks take and its advantages count once per episode.
"""
from __future__ import annotations

import asyncio
import time

import openai
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from milestream.config import Config
from milestream.infra.kafka import RecordConsumer
from milestream.infra.model import load_tokenizer
from milestream.producers.agents import openai_episode
from milestream.producers.loader import load_prompts
from milestream.producers.rollout import Sample
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.records import LogProbs, Prompt, Trajectory
from milestream.streams.groups import GroupAssembler, join_sample, record_positions
from milestream.streams.sources import refs_of
from milestream.train.collector import check_group, check_manifest
from milestream.train.learner import CollectedGroup, Learner
from openai_agents import OPENAI_LAYERS, CalculatorScript, Recording, agent_cfg, context, prompt, with_agent

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def branching_agent(base_url: str, api_key: str, task: Prompt) -> str:
    """Two tool results after one first turn (a branch), then a checker's conversation of its own."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task.question}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    answers = []
    for result in ("4", "5"):
        tool = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": result}
        answers.append(client.chat.completions.create(model="policy", messages=[*messages, first, tool],
                                                      tools=TOOLS).choices[0].message.content)
    client.chat.completions.create(model="policy", tools=TOOLS,
                                   messages=[{"role": "user", "content": "Check this problem: 1 + 1 ="}])
    return answers[0]


def leaves_of(sample: Sample) -> list[Sample]:
    return [sample, *sample.branches]


def test_every_leaf_is_the_engines_tokens_and_each_generated_token_is_trained_once(
        tokenizer: PreTrainedTokenizerBase) -> None:
    engine = Recording(CalculatorScript(tokenizer))
    ctx = with_agent(context(agent_cfg(), engine, tokenizer), branching_agent)
    task = prompt("Solve this problem: 2 + 2 =", "4")
    sample = asyncio.run(openai_episode(ctx, task, "g#0/0"))

    first, four, five, checker = engine.turns
    checked, branch_four, branch_five = leaves_of(sample)  # the latest leaf first: the checker's
    assert checked.transcript[0]["content"] == "Check this problem: 1 + 1 ="
    for leaf, (request, result) in zip((branch_four, branch_five, checked), (four, five, checker)):
        assert leaf.prompt_ids + leaf.response_ids == list(request.input_ids) + list(result.output_ids)
    # the shared first turn is trained in the first leaf that holds it, and is context in the other
    assert branch_four.prompt_ids == list(first[0].input_ids)
    assert branch_five.prompt_ids == list(four[0].input_ids[:len(first[0].input_ids) + len(first[1].output_ids)]) \
        + list(five[0].input_ids[len(first[0].input_ids) + len(first[1].output_ids):])
    trained = [[t for t, bit in zip(leaf.response_ids, leaf.loss_mask) if bit] for leaf in leaves_of(sample)]
    assert trained == [list(checker[1].output_ids), list(first[1].output_ids) + list(four[1].output_ids),
                       list(five[1].output_ids)]
    for leaf in leaves_of(sample):
        generated = [(lp, v) for lp, v, bit in zip(leaf.logprobs, leaf.versions, leaf.loss_mask) if bit]
        assert all(lp == 0.0 for lp, bit in zip(leaf.logprobs, leaf.loss_mask) if not bit) and generated
    assert (sample.turns, sample.tool_calls, sample.answer_text) == (4, 2, "<answer>4</answer>")
    (reward,) = asyncio.run(ctx.score(task, [sample]))
    assert reward.value == pytest.approx(1.1)  # asked once, for the episode: its answer was right

    too_many = with_agent(context(agent_cfg(max_leaves=2), Recording(CalculatorScript(tokenizer)), tokenizer),
                          branching_agent)
    with pytest.raises(ValueError, match="3 leaves .* more than rollout.max_leaves 2"):
        asyncio.run(openai_episode(too_many, task, "g#0/1"))


def test_an_episodes_leaves_reach_the_trainer_as_one_group(cfg: Config) -> None:
    cfg = cfg.with_overrides(rollout={**OPENAI_LAYERS, "agent_fn": f"{__name__}:branching_agent", "group_size": 2,
                                      "max_new_tokens": 64}, model={"lora_rank": 0})
    load_prompts(cfg, count=1)
    tokenizer = load_tokenizer(cfg.model)
    worker = RolloutWorker(cfg, "w-leaves", CalculatorScript(tokenizer), tokenizer)
    worker.weights_ready.set()  # the scripted engine needs no weights
    readers = {cls: RecordConsumer(cfg.broker, spec, "audit").assign(partitions=range(cfg.broker.partitions))
               for cls, spec in ((Trajectory, topics.TRAJECTORIES), (LogProbs, topics.LOGPROBS))}
    assembler, log, outcome = GroupAssembler(), {}, None

    async def until_complete() -> None:
        nonlocal outcome
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        hang_guard = time.monotonic() + 120
        while outcome is None and not task.done() and time.monotonic() < hang_guard:
            for cls, reader in readers.items():
                for delivery in await asyncio.to_thread(reader.drain, 0.5, 5.0):
                    where = delivery.position
                    log[(cls, where.partition, where.offset)] = delivery.records
                    for ref in refs_of(delivery.records, cls, where.partition, where.offset, cfg.rollout.group_size):
                        outcome = assembler.add(ref)[0] or outcome
        stop.set()
        await task

    asyncio.run(until_complete())
    for reader in readers.values():
        reader.close()
    assert outcome is not None and outcome.dropped is None
    rows = outcome.manifest
    assert [(row.sample_index, row.leaf, row.leaves) for row in rows] == [(i, leaf, 3) for i in (0, 1) for leaf in
                                                                           range(3)]
    assert len({row.trajectory_offset for row in rows if row.sample_index == 0}) == 1  # a sample is one value
    check_manifest(rows, 2, context=4096, partitions=cfg.broker.partitions)
    kinds = {topics.TRAJECTORIES: Trajectory, topics.LOGPROBS: LogProbs}
    samples = [join_sample(row, [log[(kinds[spec], row.partition, offset)][i] for spec, offset, i, _ in
                                 record_positions(row)]) for row in rows]
    check_group(samples, 2, vocab_size=len(tokenizer), context=4096)
    assert len({s.reward for s in samples}) == 1  # each leaf carries its episode's reward (both answered "4")

    learner = Learner(cfg)
    figures = learner.train_step([CollectedGroup(samples[0].group_id, samples, staleness=0)])
    assert figures["samples"] == 6 and torch.isfinite(torch.tensor(figures["loss"]))
    assert figures["reward_mean"] == pytest.approx(samples[0].reward)
