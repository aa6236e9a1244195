"""Evaluation as a consumer of weights.versions, one test per mode, on the tiny model and the real broker.

The weight versions are real disk snapshots published by the disk transport (no training): random LoRA
tensors, so every version holds different weights.
"""
from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import torch

from milestream.config import Config
from milestream.evaluate.evaluation import EngineEvaluation, EvaluationLoop, HeldOut, SharedEvaluation, shared_evaluation, \
    VersionFeed, finish_evaluation, held_out_prompts
from milestream.evaluate.external import ExternalEvaluation
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.model import load_model, load_tokenizer, load_trainable_state_dict, trainable_state_dict
from milestream.engines.engine import CpuEngine, GenerateRequest, GenerateResult, SamplingParams
from milestream.producers.loader import load_prompts
from milestream.producers.data import prompt_stream
from milestream.producers.tasks import chat_input_ids
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.records import WeightVersion
from milestream.streams.weights import publish_version

from holds import Holds

PLUGINS = str(Path(__file__).parents[1] / "plugins")


def eval_cfg(cfg: Config, **knobs) -> Config:
    # trainer.steps far away: only every_versions decides which versions are due
    return cfg.with_overrides(eval={"every_versions": 2, "num_prompts": 4, "max_new_tokens": 4, **knobs},
                              trainer={"steps": 100})


def publish_versions(cfg: Config, versions: range) -> dict[int, dict[str, torch.Tensor]]:
    """Each version a safetensors snapshot under RUN_DIR/weights announced on weights.versions (step = version)."""
    names = trainable_state_dict(load_model(cfg.model, dtype=torch.float32))
    generator = torch.Generator().manual_seed(7)
    producer = RecordProducer(cfg.broker)
    published = {}
    for version in versions:
        tensors = {name: torch.randn(t.shape, generator=generator) for name, t in names.items()}
        publish_version(producer, cfg.run.run_dir, version, version, tensors, keep=len(versions))
        published[version] = tensors
    return published


async def results_of(loop: EvaluationLoop, count: int, max_steps: int = 400) -> list:
    results = []
    for _ in range(max_steps):
        results += await loop.step(timeout=0.5)
        if len(results) >= count:
            return results
    raise AssertionError(f"only {results} after {max_steps} loop steps")


def on_topic(cfg: Config) -> list:
    consumer = RecordConsumer(cfg.broker, topics.EVAL_RESULTS, "audit").assign(partitions=[0])
    try:
        return [r for d in consumer.drain(idle_s=1.0, max_wait_s=10.0) for r in d.records]
    finally:
        consumer.close()


def test_held_out_questions_are_distinct_entries_the_loader_never_serves(cfg):
    cfg = eval_cfg(cfg, num_prompts=16, mode="dedicated").with_overrides(data={"size": 50})
    held_out = held_out_prompts(cfg)
    assert len({p.question for p in held_out}) == 16
    assert min(p.index for p in held_out) >= cfg.data.size  # past every index the training loader reads
    training = {p.question for p in islice(prompt_stream(cfg), 500)}  # ten epochs of 50 entries
    assert training and not training & {p.question for p in held_out}  # held out by question: skipped in training


def test_the_version_feed_keeps_what_a_lag_reading_took(cfg):
    producer = RecordProducer(cfg.broker)
    for version in (1, 2):  # announcements alone: the feed never opens a snapshot
        producer.send(topics.WEIGHT_VERSIONS, [WeightVersion(version, version, -1, "disk", "", [], [], 0, 0.0)])
    producer.flush()
    feed = VersionFeed(RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, "eval-test").assign(partitions=[0]))
    try:
        assert feed.lag(1, wait_s=10.0) in (0, 1)  # reads the current step: 1, or 2 if both arrived
        got = []
        while batch := feed.read(1.0):
            got += [record.version for record, _ in batch]
    finally:
        feed.close()
    assert got == [1, 2] and feed.latest_step == 2


def test_dedicated_engine_evaluates_due_versions_from_their_snapshots(cfg):
    cfg = eval_cfg(cfg, mode="dedicated")
    tensors = publish_versions(cfg, range(1, 5))
    Path(cfg.run.run_dir, "weights", "v000002.safetensors").unlink()  # version 2's snapshot is gone
    evaluation = EngineEvaluation(cfg)
    loop = EvaluationLoop(cfg, evaluation)
    skipped, ok = asyncio.run(results_of(loop, 2))

    assert (skipped.version, skipped.step, skipped.status, skipped.lag_steps) == (2, 2, "skipped", 2)
    assert "v000002.safetensors is gone" in skipped.detail and math.isnan(skipped.score)
    assert (ok.version, ok.step, ok.status, ok.lag_steps, ok.name) == (4, 4, "ok", 0, "heldout")
    assert evaluation.engine.version == 4 and json.loads(ok.detail)["prompts"] == 4
    # the same held-out set on a fresh engine given version 4's tensors directly: the same completions
    reference = CpuEngine(cfg.model, cfg.rollout)
    (expected,) = asyncio.run(reference_score(reference, cfg, 4, tensors[4]))
    assert (ok.score, ok.detail) == (expected.value, expected.detail)
    assert [(r.version, r.status) for r in on_topic(cfg)] == [(2, "skipped"), (4, "ok")]

    # a restarted evaluator carries on after its committed position: the next due version, nothing again
    asyncio.run(loop.evaluation.close())
    loop.feed.close()
    publish_versions(cfg, range(5, 7))
    restarted = EvaluationLoop(cfg, EngineEvaluation(cfg))
    (after,) = asyncio.run(results_of(restarted, 1))
    asyncio.run(restarted.evaluation.close())
    restarted.feed.close()
    assert (after.version, after.status) == (6, "ok")


async def reference_score(engine: CpuEngine, cfg: Config, version: int, tensors):
    try:
        await engine.update_weights(version, tensors)
        return await HeldOut(cfg, load_tokenizer(cfg.model)).score(engine, version)
    finally:
        await engine.close()


def test_external_evaluator_loads_an_hf_folder_and_a_failing_one_is_skipped(cfg, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    from eval_hooks import PROBE

    cfg = eval_cfg(cfg, mode="external", evaluator="eval_hooks:fails_on_version_2", keep_exports=1)
    tensors = publish_versions(cfg, range(1, 5))
    loop = EvaluationLoop(cfg, ExternalEvaluation(cfg))
    failed, *scores = asyncio.run(results_of(loop, 3))
    loop.feed.close()

    assert (failed.version, failed.status, failed.name) == (2, "skipped", "heldout")
    assert failed.detail == "RuntimeError: this evaluator fails on version 2 on purpose"
    by_name = {r.name: r for r in scores}
    assert set(by_name) == {"heldout/version", "heldout/probe_logit"}
    assert all((r.version, r.step, r.status, r.lag_steps) == (4, 4, "ok", 0) for r in scores)
    assert by_name["heldout/version"].score == 4.0
    # the folder holds version 4 with its LoRA merged: the probe matches the adapted policy's own forward
    policy = load_model(cfg.model, dtype=torch.float32)
    load_trainable_state_dict(policy, tensors[4])
    tokenizer = load_tokenizer(cfg.model)
    with torch.no_grad():
        expected = float(policy(**tokenizer(PROBE, return_tensors="pt")).logits[0, -1].max())
    assert math.isclose(by_name["heldout/probe_logit"].score, expected, rel_tol=1e-4)
    exported = Path(cfg.run.run_dir, "eval")
    assert [p.name for p in exported.iterdir()] == ["v000004"]  # eval.keep_exports=1
    assert json.loads(by_name["heldout/version"].detail)["folder"] == str(exported / "v000004")


def test_shared_engine_pauses_new_submissions_and_aborts_nothing_in_flight(cfg, tmp_path, monkeypatch):
    holds = Holds.enable(monkeypatch, tmp_path)
    cfg = eval_cfg(cfg, mode="shared", shared_worker="w-eval")
    tokenizer = load_tokenizer(cfg.model)
    tensors = publish_versions(cfg, range(1, 3))
    engine = CpuEngine(cfg.model, cfg.rollout)
    evaluation = SharedEvaluation(cfg, "w-eval", tokenizer)
    assert shared_evaluation(cfg, "w-other") is None and shared_evaluation(cfg.with_overrides(eval={"mode": "dedicated"}), "w-eval") is None

    async def scenario():
        await engine.update_weights(2, tensors[2])
        assert await evaluation.after_version(engine, 1, 1) == []  # not due: nothing runs
        long = GenerateRequest("in-flight", (1, 2, 3), SamplingParams(max_new_tokens=120, temperature=1.0))
        holds.arm("engine.stepped")
        in_flight = asyncio.create_task(engine.generate(long))
        # held after the in-flight request's first token: it is decoding when the evaluation starts
        held_by = await asyncio.to_thread(holds.wait_held, "engine.stepped", 120)
        running = asyncio.create_task(evaluation.after_version(engine, 2, 2))
        await asyncio.sleep(0)
        waiting = asyncio.create_task(evaluation.admission())
        assert evaluation.evaluating and not in_flight.done()
        holds.release("engine.stepped", held_by)  # it goes on decoding beside the evaluation
        while evaluation.evaluating:
            assert not waiting.done()  # a new submission waits for the whole evaluation
            await asyncio.sleep(0.01)
        await waiting
        return await running, await in_flight

    async def closing_engine():
        try:
            return await scenario()
        finally:
            await engine.close()
            evaluation.close()

    (result,), in_flight = asyncio.run(closing_engine())
    assert in_flight.finish_reason != "abort" and len(in_flight.output_ids) > 0
    assert (result.version, result.step, result.status, result.lag_steps) == (2, 2, "ok", 0)
    assert [(r.version, r.status) for r in on_topic(cfg)] == [(2, "ok")]


def run_shared_worker(cfg: Config, enough: Callable[[list, list], bool]) -> tuple[list, list]:
    """Worker ``w-eval`` with its shared evaluation, until ``enough(results, trajectories)``: both as seen."""
    worker = RolloutWorker(cfg, "w-eval", CpuEngine(cfg.model, cfg.rollout), load_tokenizer(cfg.model),
                           shared_evaluation(cfg, "w-eval"))
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    seen, results = [], []

    def done() -> bool:
        results.extend(on_topic(cfg)[len(results):])
        seen.extend(r for d in trajectories.drain(idle_s=0.2, max_wait_s=2) for r in d.records)
        return enough(results, seen)

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        for _ in range(240):
            if await asyncio.to_thread(done):
                break
            await asyncio.sleep(0.5)
        stop.set()
        await task
        await worker.engine.close()

    asyncio.run(run())
    trajectories.close()
    return results, seen


def test_shared_mode_runs_inside_the_rollout_worker(cfg):
    cfg = eval_cfg(cfg, mode="shared", shared_worker="w-eval")
    publish_versions(cfg, range(3, 4))  # the engine jumps from 0 to 3, over the due version 2: 3 is evaluated
    load_prompts(cfg, count=8)
    results, seen = run_shared_worker(cfg, lambda results, seen: bool(results) and len(seen) >= cfg.rollout.group_size)
    assert [(r.version, r.step, r.status) for r in results] == [(3, 3, "ok")]
    assert seen and all(t.status != "aborted" and set(t.token_versions) == {3} for t in seen)


def test_shared_evaluation_scores_the_initial_weights_before_any_rollout(cfg):
    cfg = eval_cfg(cfg, mode="shared", shared_worker="w-eval")
    load_prompts(cfg, count=8)  # no weight version published: the engine starts on the initial weights
    results, seen = run_shared_worker(cfg, lambda results, seen: bool(seen))
    (result,) = results
    assert (result.version, result.step, result.status, result.lag_steps) == (0, 0, "ok", 0)
    assert result.ts <= min(t.submitted_at for t in seen)  # published before the first group started


class ScriptedEngine:
    """Answers evaluation request ``eval-vV/i`` with ``answers[i]`` (greedy outputs, made up)."""

    def __init__(self, tokenizer, answers: list[str], version: int = 0):
        self.tokenizer, self.answers, self.version = tokenizer, answers, version
        self.prompts: list[tuple[int, ...]] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.prompts.append(request.input_ids)
        index = int(request.request_id.rsplit("/", 1)[1])
        ids = tuple(self.tokenizer(self.answers[index], add_special_tokens=False)["input_ids"])
        return GenerateResult(request.request_id, ids, (0.0,) * len(ids), (self.version,) * len(ids), "stop")


def test_held_out_scores_with_the_configured_reward_on_the_rollout_prompt(cfg, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"}], "label": str(i + 2)} for i in range(4)]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 9 + 2?"}], "label": "11"}) + "\n")
    cfg = cfg.with_overrides(data={"path": str(train), "prompt_key": "messages", "system_prompt": "Be brief."},
                             reward={"fn": "reward_hooks:graded"}, eval={"path": str(held), "num_prompts": 4})
    tokenizer = load_tokenizer(cfg.model)
    engine = ScriptedEngine(tokenizer, [row["label"] if i % 2 == 0 else "wrong answer" for i, row in enumerate(rows)])
    (scored,) = asyncio.run(HeldOut(cfg, tokenizer).score(engine, 0))

    # reward_hooks:graded gives {correct, short}: the score is their sum's mean, each component in the detail
    detail = json.loads(scored.detail)
    assert scored.value == 1.0 and detail["components"] == {"correct": 0.5, "short": 0.5}
    assert detail["reward_errors"] == 0 and detail["prompts"] == 4
    # the prompt as rollout builds it: the system prompt, the row's own chat messages
    expected = chat_input_ids(tokenizer, [{"role": "system", "content": "Be brief."}, *rows[0]["messages"]], "")
    assert engine.prompts[0] == tuple(expected)


def test_held_out_score_of_the_demo_is_accuracy_without_the_format_reward(cfg):
    cfg = eval_cfg(cfg, mode="shared")
    tokenizer = load_tokenizer(cfg.model)
    heldout = HeldOut(cfg, tokenizer)
    answers = [f"{p.answer}</answer>" if i % 2 else "no tag" for i, p in enumerate(heldout.prompts)]
    (scored,) = asyncio.run(heldout.score(ScriptedEngine(tokenizer, answers), 0))
    assert scored.value == 0.5  # half right, their closed tags earn nothing (data.format_reward is 0.1)
    assert heldout.input_ids[0] == tuple(chat_input_ids(
        tokenizer, [{"role": "system", "content": cfg.data.system_prompt},
                    {"role": "user", "content": heldout.prompts[0].question}], cfg.data.assistant_prefill))


def test_the_version_a_run_ends_on_is_evaluated_once_and_a_failure_is_skipped(cfg):
    cfg = eval_cfg(cfg, mode="shared")
    publish_versions(cfg, range(1, 4))  # nothing on eval.results: the newest version has no result
    everything, new = finish_evaluation(cfg)
    assert everything == new and [(r.version, r.step, r.status, r.lag_steps) for r in new] == [(3, 3, "ok", 0)]
    assert finish_evaluation(cfg) == (new, [])  # it has a result now: nothing runs again

    publish_versions(cfg, range(4, 5))
    Path(cfg.run.run_dir, "weights", "v000004.safetensors").unlink()
    everything, (gone,) = finish_evaluation(cfg)
    assert (gone.version, gone.status) == (4, "skipped") and "v000004.safetensors is gone" in gone.detail
    assert [r.version for r in everything] == [3, 4]


REFUSED_QUESTIONS: set[str] = set()  # the held-out questions ``answering_agent`` fails on


def answering_agent(base_url: str, api_key: str, task) -> str:
    """One chat turn through the episode's endpoint, with the real ``openai`` client; fails when told to."""
    import openai

    if task.question in REFUSED_QUESTIONS:
        raise ValueError("this agent gives up here")
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task.question}])
    return reply.choices[0].message.content


class QuestionEngine:
    """Answers each held-out question it is shown with ``answers[question]``, recording its sampling."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer, self.answers, self.version = tokenizer, answers, 0
        self.temperatures: list[float] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.temperatures.append(request.sampling.temperature)
        shown = self.tokenizer.decode(request.input_ids)
        (text,) = [answer for question, answer in self.answers.items() if question in shown]
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + (self.tokenizer.eos_token_id,)
        return GenerateResult(request.request_id, ids, (0.0,) * len(ids), (0,) * len(ids), "stop")


def test_an_agents_run_is_evaluated_by_greedy_episodes_of_its_agent(cfg):
    """With an agent (rollout.agent_fn) the held-out score is the agent's: one greedy episode per prompt through
    its endpoint, its answer scored by the reward; an episode that fails is a reward error, left out."""
    cfg = eval_cfg(cfg, mode="shared", max_new_tokens=16).with_overrides(
        rollout={"generate_fn": "milestream.producers.agents:openai_episode", "agent_fn": f"{__name__}:answering_agent"},
        data={"assistant_prefill": ""})
    tokenizer = load_tokenizer(cfg.model)
    heldout = HeldOut(cfg, tokenizer)
    prompts = heldout.prompts
    answers = {p.question: f"<answer>{p.answer}</answer>" if i % 2 == 0 else "<answer>none</answer>"
               for i, p in enumerate(prompts)}
    REFUSED_QUESTIONS.add(prompts[-1].question)
    engine = QuestionEngine(tokenizer, answers)
    try:
        (scored,) = asyncio.run(heldout.score(engine, 0))
    finally:
        REFUSED_QUESTIONS.clear()
    detail = json.loads(scored.detail)
    assert detail["reward_errors"] == 1 and detail["prompts"] == len(prompts)
    assert scored.value == 2 / 3  # prompts 0 and 2 right, 1 wrong, 3 failed (left out)
    assert engine.temperatures == [0.0] * (len(prompts) - 1)  # greedy, one turn each
