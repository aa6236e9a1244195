"""Held-out evaluation as a consumer of ``weights.versions``, in Miles' three modes (``eval.mode``).

  shared     the rollout engine of worker ``eval.shared_worker`` evaluates: the worker awaits
             ``SharedEvaluation.admission()`` before each new submission and calls ``after_version`` once it
             has applied a version; meanwhile new submissions wait and the requests in flight go on
  dedicated  ``milestream eval`` with a CpuEngine of its own that loads each due version through the
             configured transport's receiver (disk: the version's safetensors snapshot; disk-delta: the chain)
  external   ``milestream eval`` writes each due version as an HF-loadable folder and calls the user's
             ``eval.evaluator(folder)`` (evaluate/external.py)

A version is due when ``version % eval.every_versions == 0`` (version 0, the initial weights, included:
a shared engine evaluates it when it starts, before it admits a prompt) or it is the last step's; at its
end ``milestream run`` evaluates the version it ended on if no evaluator did (``finish_evaluation``). The
held-out set is ``eval.num_prompts`` distinct questions held out by question: the rows of ``eval.path``, or
the first distinct questions from task indices ``data.size`` onwards, which the loader then skips; prompted
as rollout prompts and decoded greedily (with ``rollout.agent_fn``: one greedy episode of the agent each); the score is the configured reward's mean without the format
reward (``HeldOut``). Each result on ``eval.results`` names the version and step that produced it and
``lag_steps``: the newest step announced on ``weights.versions`` when the result is published, minus the
version's step. A failed evaluation (an exception, ``eval.timeout_s``, a snapshot gone) is a result with
status ``skipped``, score NaN and the reason in ``detail``; the consumer and training go on.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any, Protocol

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from milestream.config import Config, import_path
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.model import configure_process, load_tokenizer, stop_token_ids
from milestream.infra.offsets import Checkpoint
from milestream.log.lineage import check_observed
from milestream.engines.engine import CpuEngine, Engine, GenerateRequest, SamplingParams, sampling_params
from milestream.producers.data import held_out, prompt_messages, sources
from milestream.producers.rewards import Reward, RewardSample, load_reward
from milestream.producers.rollout import RolloutContext, load_layers
from milestream.producers.tasks import chat_input_ids
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import EvalResult, Prompt, WeightVersion
from milestream.streams.ledger import BufferLedger
from milestream.streams.versions import version_check
from milestream.streams.weights.base import TRANSPORTS, make_receiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    name: str
    value: float
    detail: str


class VersionEvaluation(Protocol):
    """What ``milestream eval`` runs on each due version (dedicated engine, external evaluator)."""

    async def __call__(self, record: WeightVersion) -> list[Score]: ...

    async def close(self) -> None: ...


def is_due(cfg: Config, version: int, step: int) -> bool:
    return version % cfg.eval.every_versions == 0 or step == cfg.trainer.steps


def held_out_prompts(cfg: Config) -> list[Prompt]:
    """``eval.num_prompts`` distinct questions training never sees: the rows of ``eval.path``, or task
    entries past ``data.size`` whose questions the loader skips (producers/data.py ``held_out``), as
    prompts of the first task source (of the first source for ``eval.path``), so that the policy and the
    reward see them as they see a training prompt of that source."""
    task_source = next((s for s in sources(cfg) if s.task_data is not None), None)
    source = sources(cfg)[0] if cfg.eval.path or task_source is None else task_source
    return [Prompt(f"{cfg.eval.name}-{i}", source.name, p.index, p.question, p.answer, json.dumps(p.entry))
            for i, p in enumerate(held_out(cfg))]


def reward_sample(cfg: Config, prompt: Prompt, prompt_ids: Sequence[int], response_ids: Sequence[int],
                  finish_reason: str, text: str, **episode: Any) -> RewardSample:
    """What the reward sees of a held-out completion (or an agent's episode: ``turns``, ``tool_calls``,
    ``transcript``): a task entry is its metadata, its answer the label (as in training); an ``eval.path``
    row gives its label and metadata."""
    entry = json.loads(prompt.entry_json)
    label, metadata = (entry["answer"] or None, entry["metadata"]) if cfg.eval.path else (prompt.answer, entry)
    return RewardSample.of(cfg, prompt, label, metadata, response=text, prompt_ids=tuple(prompt_ids),
                           response_ids=tuple(response_ids), finish_reason=finish_reason, **episode)


class HeldOut:
    """The held-out prompts encoded for the policy as rollout encodes them (chat messages, system prompt,
    prefill: ``producers/rollout.py`` ``single_turn``), and the greedy evaluation of an engine on them.

    The score is the mean of the configured reward (``reward.*``) without ``data.format_reward``: for the
    reasoning-gym demo (answer-tag verifier) the accuracy. A dict reward's components' means go into the
    result's detail (``components``), beside the score of the one result; a sample whose reward failed is
    left out of the mean and counted (``reward_errors``)."""

    def __init__(self, cfg: Config, tokenizer: PreTrainedTokenizerBase):
        self.cfg, self.tokenizer = cfg, tokenizer
        # an agent's run is evaluated as it trains: one greedy episode of its agent per prompt
        self.agent_layers = load_layers(cfg) if cfg.rollout.agent_fn else None
        self.prompts = held_out_prompts(cfg)
        self.input_ids = [tuple(chat_input_ids(tokenizer, prompt_messages(cfg, p), cfg.data.assistant_prefill))
                          for p in self.prompts]
        self.sampling = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                                       temperature=0.0, stop_token_ids=stop_token_ids(tokenizer))
        without_format = cfg.model_copy(update={"data": cfg.data.model_copy(update={"format_reward": 0.0})})
        self.reward = load_reward(without_format)

    async def score(self, engine: Engine, version: int) -> list[Score]:
        """All prompts at once: they join whatever the engine is running, which goes on undisturbed."""
        if self.agent_layers is None:
            texts, samples = await self._completions(engine, version)
        else:
            texts, samples = await self._episodes(engine, version)
        if engine.version != version:
            raise RuntimeError(f"the engine moved to version {engine.version} while evaluating version {version}")
        asked = [sample for sample in samples if isinstance(sample, RewardSample)]
        scored_by_model = iter(await self.reward(asked) if asked else ())
        rewards = [next(scored_by_model) if isinstance(sample, RewardSample) else sample for sample in samples]
        scored = [reward for reward in rewards if not reward.error]
        if not scored:
            raise RuntimeError(f"the reward failed on all {len(rewards)} held-out completions: {rewards[0].error}")
        components = {name: mean(r.components[name] for r in scored if name in r.components)
                      for name in dict.fromkeys(name for r in scored for name in r.components)}
        value = mean(reward.value for reward in scored)
        detail = {"score": value, "prompts": len(texts), "reward_errors": len(rewards) - len(scored),
                  "max_new_tokens": self.sampling.max_new_tokens, "example": texts[0],
                  **({"components": components} if components else {})}
        return [Score(self.cfg.eval.name, value, json.dumps(detail))]

    async def _completions(self, engine: Engine, version: int) -> tuple[list[str], list[RewardSample]]:
        requests = [GenerateRequest(f"eval-v{version}/{i}", ids, self.sampling) for i, ids in enumerate(self.input_ids)]
        results = await asyncio.gather(*(engine.generate(request) for request in requests))
        aborted = sum(result.finish_reason == "abort" for result in results)
        if aborted:
            raise RuntimeError(f"the engine aborted {aborted} of {len(results)} evaluation requests")
        texts = [self.tokenizer.decode(result.output_ids, skip_special_tokens=True) for result in results]
        return texts, [reward_sample(self.cfg, prompt, ids, result.output_ids, result.finish_reason, text)
                       for prompt, ids, result, text in zip(self.prompts, self.input_ids, results, texts)]

    async def _episodes(self, engine: Engine, version: int) -> tuple[list[str], list[RewardSample | Reward]]:
        """One greedy episode of the run's agent per prompt (its generate function, as a rollout worker runs
        it); an episode's reported reward stands as it is, and a failed episode is a reward error."""
        greedy = self.cfg.model_copy(update={"rollout": self.cfg.rollout.model_copy(update={
            "temperature": 0.0, "max_new_tokens": self.sampling.max_new_tokens})})
        ctx = RolloutContext(greedy, f"eval-v{version}", engine, self.tokenizer,
                             sampling_params(greedy.rollout, self.tokenizer), None, self.agent_layers.agent)
        episodes = await asyncio.gather(*(self.agent_layers.generate(ctx, prompt, f"eval-v{version}/{i}")
                                          for i, prompt in enumerate(self.prompts)), return_exceptions=True)
        texts, samples = [], []
        for prompt, episode in zip(self.prompts, episodes):
            if isinstance(episode, BaseException):
                texts.append("")
                samples.append(Reward(0.0, error=f"{type(episode).__name__}: {episode}"[:500]))
                continue
            texts.append(episode.answer_text)
            samples.append(episode.reported or reward_sample(
                self.cfg, prompt, episode.prompt_ids, episode.response_ids, episode.finish_reason,
                episode.answer_text, turns=episode.turns, tool_calls=episode.tool_calls,
                transcript=tuple(episode.transcript or ())))
        return texts, samples


class VersionFeed:
    """``weights.versions`` as an evaluator reads it; the newest step announced is the trainer's current one.
    ``keep``: the records are wanted too (the loop), not only the step (a shared engine)."""

    def __init__(self, consumer: RecordConsumer, keep: bool = True):
        self.consumer, self.keep = consumer, keep
        self.latest_step = 0
        self.unread: list[tuple[WeightVersion, int]] = []  # (record, the offset after it)

    def read(self, timeout: float) -> list[tuple[WeightVersion, int]]:
        """What arrived since the last read (waiting up to ``timeout`` when nothing did)."""
        self._fetch(0.0 if self.unread else timeout)
        out, self.unread = self.unread, []
        return out

    def lag(self, step: int, wait_s: float = 0.1) -> int:
        self._fetch(wait_s)
        return max(self.latest_step, step) - step

    def _fetch(self, timeout: float) -> None:
        delivery = self.consumer.poll(timeout)
        while delivery is not None:
            for record in delivery.records:
                self.latest_step = max(self.latest_step, record.step)
                if self.keep:
                    self.unread.append((record, delivery.position.offset + 1))
            delivery = self.consumer.poll(0.0)

    def close(self) -> None:
        self.consumer.close()


async def guarded(evaluation: Awaitable[list[Score]], timeout_s: float) -> list[Score] | str:
    """The scores, or the reason there are none: a failed evaluation never leaves here as an exception."""
    try:
        return await asyncio.wait_for(evaluation, timeout_s)
    except Exception as exc:  # noqa: BLE001 - recorded as skipped; the consumer and training go on
        if isinstance(exc, TimeoutError) and not str(exc):
            return f"timed out after {timeout_s:g}s (eval.timeout_s)"
        log.warning("evaluation failed", exc_info=exc)
        return f"{type(exc).__name__}: {exc}"


async def publish_outcome(cfg: Config, version: int, step: int, outcome: list[Score] | str,
                          feed: VersionFeed, producer: RecordProducer) -> list[EvalResult]:
    """The results of one version's evaluation on ``eval.results`` (a reason: one ``skipped`` result)."""
    results = eval_results(cfg, version, step, outcome, await asyncio.to_thread(feed.lag, step))
    producer.send(topics.EVAL_RESULTS, results)
    producer.flush()
    return results


def eval_results(cfg: Config, version: int, step: int, outcome: list[Score] | str, lag: int) -> list[EvalResult]:
    """One version's evaluation as results (a reason: one ``skipped`` result), each logged."""
    now = time.time()
    if isinstance(outcome, str):
        results = [EvalResult(cfg.eval.name, version, step, math.nan, lag, "skipped", outcome, now)]
    else:
        results = [EvalResult(s.name, version, step, s.value, lag, "ok", s.detail, now) for s in outcome]
    for r in results:
        log.info("eval %s version %d (step %d, lag %d): %s %s", r.name, r.version, r.step, r.lag_steps, r.status,
                 f"{r.score:.4f}" if r.status == "ok" else r.detail)
    return results


class SharedEvaluation:
    """``eval.mode: shared``: the hook (``producers.worker.EngineHook``) that evaluates due versions on the
    rollout engine of worker ``eval.shared_worker``; new submissions wait while it runs."""

    def __init__(self, cfg: Config, worker_id: str, tokenizer: PreTrainedTokenizerBase):
        self.cfg = cfg
        self.producer = RecordProducer(cfg.broker, client_id=f"eval-shared-{worker_id}")
        self._open = asyncio.Event()
        self._open.set()
        self._applied: int | None = None  # the newest version this engine applied (0: the initial weights)
        self.heldout = HeldOut(cfg, tokenizer)
        self.feed = VersionFeed(versions_reader(cfg, f"{worker_id}-eval-steps", self.producer).assign(partitions=[0]),
                                keep=False)

    async def admission(self) -> None:
        """Returns at once unless an evaluation runs; then when it is over."""
        await self._open.wait()

    @property
    def evaluating(self) -> bool:
        return not self._open.is_set()

    async def after_version(self, engine: Engine, version: int, step: int) -> list[EvalResult]:
        """Call after each applied version, and with version 0 when the engine starts on the initial weights.
        An engine that follows only the newest version may jump over a multiple of ``eval.every_versions``:
        the first version it applies at or past one is evaluated."""
        previous = self._applied
        self._applied = version if previous is None else max(previous, version)
        every = self.cfg.eval.every_versions
        crossed = version // every > (previous or 0) // every
        if (previous is not None and version <= previous) or not (crossed or is_due(self.cfg, version, step)):
            return []
        self._open.clear()
        try:
            outcome = await guarded(self.heldout.score(engine, version), self.cfg.eval.timeout_s)
        finally:
            self._open.set()
        return await publish_outcome(self.cfg, version, step, outcome, self.feed, self.producer)

    def close(self) -> None:
        self.feed.close()
        self.producer.flush()


def shared_evaluation(cfg: Config, worker_id: str) -> SharedEvaluation | None:
    """The rollout worker's engine hook: a SharedEvaluation on worker ``eval.shared_worker`` in shared mode."""
    if cfg.eval.mode != "shared" or worker_id != cfg.eval.shared_worker:
        return None
    return SharedEvaluation(cfg, worker_id, load_tokenizer(cfg.model))


class EvaluationLoop:
    """``milestream eval``: the due versions in order, one at a time; the read position is committed
    after each result, so a restarted evaluator neither repeats nor misses one."""

    def __init__(self, cfg: Config, evaluation: VersionEvaluation):
        self.cfg, self.evaluation = cfg, evaluation
        self.producer = RecordProducer(cfg.broker, client_id=f"eval-{cfg.eval.mode}")
        consumer = versions_reader(cfg, f"{cfg.broker.topic_prefix}eval-{cfg.eval.mode}", self.producer)
        # assigned, not subscribed: a lone reader needs no group join (seconds on tansu), only its committed offset
        self.feed = VersionFeed(consumer.assign(consumer.committed([0]), partitions=[0]))
        self.evaluated_to: dict[int, int] = {}  # the next offset after the last version whose result is out
        self.checkpoint = Checkpoint(self.producer, consumer, lambda: self.evaluated_to)
        self.pending: deque[tuple[WeightVersion, int]] = deque()
        # (version, checksums): a step the trainer redid after a crash is evaluated again only if it differs
        self.queued: set[tuple[int, int]] = set()

    async def step(self, timeout: float = 0.5) -> list[EvalResult]:
        """Read what arrived, then evaluate the oldest pending due version (if there is one)."""
        for record, next_offset in await asyncio.to_thread(self.feed.read, 0.0 if self.pending else timeout):
            identity = (record.version, hash(tuple(record.checksums)))
            if is_due(self.cfg, record.version, record.step) and identity not in self.queued:
                self.queued.add(identity)
                self.pending.append((record, next_offset))
        if not self.pending:
            return []
        record, next_offset = self.pending.popleft()
        outcome = await guarded(self.evaluation(record), self.cfg.eval.timeout_s)
        results = await publish_outcome(self.cfg, record.version, record.step, outcome, self.feed, self.producer)
        self.evaluated_to = {0: next_offset}
        self.checkpoint.commit()
        return results

    async def run(self, stop: threading.Event) -> None:
        log.info("evaluating every %d versions (eval.mode %s)", self.cfg.eval.every_versions, self.cfg.eval.mode)
        try:
            while not stop.is_set():
                await self.step()
        finally:
            await self.evaluation.close()
            self.producer.flush()
            self.feed.close()


class EngineEvaluation:
    """``eval.mode: dedicated``: a CpuEngine of its own loads each due version and runs the held-out set.
    ``delivered`` False: no weight transport, the weights are handed to ``of_weights`` (a fork's)."""

    def __init__(self, cfg: Config, engine: Engine | None = None, delivered: bool = True):
        if delivered:
            require_skippable_transport(cfg)
        self.engine = engine or CpuEngine(cfg.model, cfg.rollout, inflight="keep")
        self.receiver = make_receiver(cfg, "evaluator") if delivered else None
        self.heldout = HeldOut(cfg, load_tokenizer(cfg.model))

    async def __call__(self, record: WeightVersion) -> list[Score]:
        assert self.receiver is not None, "an evaluation made with delivered=False is handed its weights"
        return await self.of_weights(record.version, await asyncio.to_thread(self.receiver.receive, record))

    async def of_weights(self, version: int, tensors: Mapping[str, Tensor]) -> list[Score]:
        await self.engine.update_weights(version, tensors)
        return await self.heldout.score(self.engine, version)

    async def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        await self.engine.close()


class HeldOutOfWeights:
    """The held-out evaluation of weights in hand (a fork's versions, which no transport delivers: observe/fork.py)
    by an ``EngineEvaluation`` made at the first due version. One event loop for its life, the engine's."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.runner = asyncio.Runner()
        self.evaluation: EngineEvaluation | None = None

    def __call__(self, version: int, step: int, tensors: Mapping[str, Tensor], last: bool) -> list[EvalResult]:
        """The results of a due version (``last``: the fork's last step, always due), else []."""
        if not (last or is_due(self.cfg, version, step)):
            return []

        async def evaluate() -> list[Score]:
            if self.evaluation is None:
                self.evaluation = EngineEvaluation(self.cfg, delivered=False)
            return await self.evaluation.of_weights(version, tensors)

        return eval_results(self.cfg, version, step, self.runner.run(guarded(evaluate(), self.cfg.eval.timeout_s)), 0)

    def close(self) -> None:
        if self.evaluation is not None:
            self.runner.run(self.evaluation.close())
        self.runner.close()


def require_skippable_transport(cfg: Config) -> None:
    """A receiver that must join every version's delivery (a collective sized for the rollout engines)
    cannot serve an evaluator that loads only the due versions."""
    receiver = import_path(TRANSPORTS[cfg.weights.transport][1], "weights.transport")
    if receiver.every_version:
        where = "the version a run ends on is evaluated outside the rollout engines: it" if cfg.eval.mode == "shared" \
            else f"eval.mode {cfg.eval.mode}"
        raise ValueError(f"{where} loads versions through weights.transport {cfg.weights.transport!r}, whose "
                         f"engines must take part in every delivery; use weights.transport disk or disk-delta"
                         f"{'' if cfg.eval.mode == 'shared' else ', or eval.mode shared'}")


def make_evaluation(cfg: Config) -> VersionEvaluation:
    if cfg.eval.mode == "dedicated":
        return EngineEvaluation(cfg)
    if cfg.eval.mode == "external":
        from milestream.evaluate.external import ExternalEvaluation

        return ExternalEvaluation(cfg)
    raise ValueError(f"milestream eval runs eval.mode dedicated or external, not {cfg.eval.mode!r} "
                     f"(shared runs inside the rollout workers)")


def finish_evaluation(cfg: Config) -> tuple[list[EvalResult], list[EvalResult]]:
    """The end of ``milestream run``, its stages stopped: (every result on ``eval.results``, the new ones).

    A run that stops at ``run.max_wall_s`` ends on a version no evaluator was due to reach, or reached too
    late: the newest version on ``weights.versions`` with no result is evaluated here, by an in-process
    engine loading it from the run folder (``EngineEvaluation``; the user's evaluator in external mode),
    and published like any other result, or as ``skipped`` with the reason. A run that trained no step
    ends on the initial weights: version 0 is evaluated by an engine of its own (not in external mode,
    whose evaluator takes announced versions only)."""
    producer = RecordProducer(cfg.broker, client_id="eval-run-end")
    results = read_all(cfg, RecordConsumer(cfg.broker, topics.EVAL_RESULTS, f"{cfg.broker.topic_prefix}run-end-eval",
                                           deadletter=producer, check=functools.partial(_check_result, cfg)))
    versions = read_all(cfg, versions_reader(cfg, f"{cfg.broker.topic_prefix}run-end-eval", producer))
    producer.flush()
    newest = max(reversed(versions), key=lambda record: record.version, default=None)  # a redone step: its last record
    ends_on = newest.version if newest else 0  # no step within the budget: the run ends on the initial weights
    if any(result.version == ends_on for result in results) or (newest is None and cfg.eval.mode == "external"):
        return results, []
    new = asyncio.run(evaluate_once(cfg, newest))  # the stages have stopped: every core is this one's
    return results + new, new


def versions_reader(cfg: Config, group_id: str, producer: RecordProducer) -> RecordConsumer:
    """A reader of weights.versions that dead-letters what the run's trainer did not announce."""
    return RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, group_id, deadletter=producer,
                          check=version_check(cfg, BufferLedger(cfg)))


def _check_result(cfg: Config, records: list[EvalResult], position: Position) -> None:
    for record in records:  # the run monitor dead-lettered these already: here they are only passed over
        check_observed(record, position, cfg.trainer.steps, cfg.trainer.batch_groups, lambda _: True, True)


def read_all(cfg: Config, consumer: RecordConsumer) -> list:
    consumer.assign(partitions=[0])
    try:
        # the stages have stopped: read to the end offsets, then only what the last fetch brought with them
        return [record for delivery in consumer.drain(idle_s=0.2, max_wait_s=30.0) for record in delivery.records]
    finally:
        consumer.close()


async def evaluate_once(cfg: Config, record: WeightVersion | None) -> list[EvalResult]:
    """Evaluates ``record``'s version, or the initial weights (version 0, never announced) when None."""
    producer = RecordProducer(cfg.broker, client_id="eval-run-end")
    feed = VersionFeed(versions_reader(cfg, f"{cfg.broker.topic_prefix}run-end-eval", producer).assign(partitions=[0]),
                       keep=False)
    evaluations: list[VersionEvaluation] = []

    async def evaluate() -> list[Score]:
        build = EngineEvaluation if cfg.eval.mode == "shared" or record is None else make_evaluation
        evaluations.append(evaluation := await asyncio.to_thread(build, cfg))
        if record is None:
            return await evaluation.heldout.score(evaluation.engine, 0)
        return await evaluation(record)

    try:
        outcome = await guarded(evaluate(), cfg.eval.timeout_s)
        version, step = (record.version, record.step) if record else (0, 0)
        return await publish_outcome(cfg, version, step, outcome, feed, producer)
    finally:
        for evaluation in evaluations:
            await evaluation.close()
        feed.close()
        producer.flush()


def run_evaluator(cfg: Config, stop: threading.Event) -> None:
    configure_process(cfg.model)
    evaluation = make_evaluation(cfg)
    asyncio.run(EvaluationLoop(cfg, evaluation).run(stop))
