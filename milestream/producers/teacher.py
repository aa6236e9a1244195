"""``milestream teacher``: the teacher of on-policy distillation (``distill``, distill_config.py).

It reads rollout.trajectories and publishes, for every trajectory, the teacher's log-prob of each response
token given the prompt and the response before it (a forward, nothing generated) on
rollout.teacher_logprobs, keyed by group id as the rollout records are, so the processor joins it into the
group like a sample's log-probs. ``milestream run`` starts it when ``distill`` names a teacher.

The teacher is ``distill.teacher_path``, a local model folder scored by a CpuEngine of this stage's own (the
run's dtype and rollout.true_on_policy numerics: a teacher with the student's weights scores every token as
the student's engine recorded it, bit for bit), or ``distill.teacher_url``, an engine behind SGLang's HTTP
API. Either scores at rollout.temperature, the student's.

A trajectory's offset is held from its read until its teacher record is delivered, and only what lies below
the oldest held is committed (infra/offsets.py): a restarted teacher re-reads what it had not delivered and
publishes it again, a duplicate the processor passes over. A record no rollout worker of the run wrote (a
broken rule of streams/sources.py, a group no worker admitted, a token past the teacher's vocabulary or
context) is dead-lettered, and the stage carries on.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time

from milestream.config import Config, ModelConfig
from milestream.engines.engine import CpuEngine
from milestream.engines.http_engine import HttpEngine
from milestream.engines.scoring import Scorer, ScoreRequest
from milestream.infra.kafka import Admin, Delivery, RecordConsumer, RecordProducer
from milestream.infra.model import ModelFolderError, configure_process, load_tokenizer, model_config
from milestream.infra.offsets import Checkpoint, HeldOffsets
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Metrics, TeacherLogProbs, Trajectory
from milestream.streams.ledger import BufferLedger
from milestream.streams.sources import MismatchError, refs_of

log = logging.getLogger(__name__)


def teacher_model(cfg: Config) -> ModelConfig:
    """The teacher folder as a model of the run: its dtype, seed and threads, whole (no LoRA)."""
    return cfg.model.model_copy(update={"path": cfg.distill.teacher_path, "lora_rank": 0, "lora_targets": None})


def check_teacher(cfg: Config) -> None:
    """Before any stage starts: a teacher folder is a model folder (infra/model.py) whose tokenizer is the
    student's (the teacher scores the student's token ids) and whose context holds a trajectory."""
    if not cfg.distill.teacher_path:
        return
    teacher = teacher_model(cfg)
    where = f"distill.teacher_path {cfg.distill.teacher_path}"
    context = model_config(teacher).get_text_config().max_position_embeddings
    if load_tokenizer(teacher).get_vocab() != load_tokenizer(cfg.model).get_vocab():
        raise ModelFolderError(f"{where}: its tokenizer's vocabulary is not the student's; the teacher scores the "
                               "student's token ids")
    if context < cfg.rollout.max_context_tokens:
        raise ModelFolderError(f"{where}: a context of {context} tokens, short of rollout.max_context_tokens "
                               f"({cfg.rollout.max_context_tokens})")


def make_teacher(cfg: Config) -> Scorer:
    if cfg.distill.teacher_url:
        return HttpEngine(cfg.distill.teacher_url, timeout_s=cfg.distill.timeout_s)
    return CpuEngine(teacher_model(cfg), cfg.rollout, inflight="keep")


def consumer_group(cfg: Config) -> str:
    return f"{cfg.broker.topic_prefix}teacher"


class TeacherStage:
    """Reads trajectories, scores them on the teacher ``distill.batch_samples`` at a time, publishes and
    commits; ``scorer`` defaults to the configured teacher."""

    def __init__(self, cfg: Config, scorer: Scorer | None = None):
        self.cfg = cfg
        self.teacher = cfg.distill.teacher_path or cfg.distill.teacher_url or ""
        self.scorer = scorer or make_teacher(cfg)
        text = model_config(teacher_model(cfg) if cfg.distill.teacher_path else cfg.model).get_text_config()
        self.vocab_size, self.context = text.vocab_size, text.max_position_embeddings
        self.producer = RecordProducer(cfg.broker, client_id="teacher")
        self.ledger = BufferLedger(cfg)
        consumer = RecordConsumer(cfg.broker, topics.TRAJECTORIES, consumer_group(cfg), deadletter=self.producer,
                                  check=self._check)
        partitions = Admin(cfg.broker).partitions(topics.TRAJECTORIES)
        # assigned, not subscribed: one teacher reads every partition and needs no group join (seconds on tansu)
        committed = consumer.committed(partitions)
        self.consumer = consumer.assign(committed, partitions=partitions)
        self.held: HeldOffsets[int] = HeldOffsets(resumed=committed)
        self.checkpoint = Checkpoint(self.producer, self.consumer, self.held.committable)
        self.samples = self.tokens = 0
        self.score_s = 0.0
        self.reported = time.monotonic()

    def _check(self, records: list[Trajectory], position: Position) -> None:
        try:
            refs_of(records, Trajectory, position.partition, position.offset, self.cfg.rollout.group_size)
        except MismatchError as exc:
            raise RecordError(position, exc.field, str(exc)) from None
        for record in records:
            if record.response_ids and not record.prompt_ids:
                raise RecordError(position, "prompt_ids", "a response without a prompt")
            tokens = record.prompt_ids + record.response_ids
            if max(tokens, default=0) >= self.vocab_size or len(tokens) > self.context:
                raise RecordError(position, "response_ids", f"{len(tokens)} tokens, ids up to {max(tokens)}: past "
                                  f"the teacher's vocabulary ({self.vocab_size}) or context ({self.context})")
            if not (self.ledger.is_admitted(record.group_id) or self.ledger.settlement(record.group_id)):
                raise RecordError(position, "group_id", f"no rollout worker admitted group {record.group_id!r}")

    async def step(self, timeout: float = 0.5) -> int:
        """Score what arrived (waiting up to ``timeout`` for the first); how many trajectories it published."""
        deliveries = await asyncio.to_thread(self._read, timeout)
        trajectories = [t for d in deliveries for t in d.records]
        if trajectories:
            started = time.monotonic()
            temperature = self.cfg.rollout.temperature
            scores = await self.scorer.score([ScoreRequest(tuple(t.prompt_ids), tuple(t.response_ids), temperature)
                                              for t in trajectories])
            self.score_s += time.monotonic() - started
            for t, logprobs in zip(trajectories, scores):
                record = TeacherLogProbs(t.trajectory_id, t.group_id, t.sample_index, t.group_size, logprobs,
                                         self.teacher)
                self.producer.send(topics.TEACHER_LOGPROBS, [record], key=t.group_id)
            self.samples += len(trajectories)
            self.tokens += sum(len(t.response_ids) for t in trajectories)
        for delivery in deliveries:  # scored: a restart need not read them again, once their scores are on the log
            self.held.done(delivery.position.partition, delivery.position.offset)
        if deliveries:
            await asyncio.to_thread(self.checkpoint.commit, wait=False)
        self._report()
        return len(trajectories)

    def _read(self, timeout: float) -> list[Delivery[Trajectory]]:
        """Up to ``distill.batch_samples`` trajectories: what is there, once the first has come."""
        out: list[Delivery[Trajectory]] = []
        count = 0
        while count < self.cfg.distill.batch_samples and (delivery := self.consumer.poll(0.0 if out else timeout)):
            self.held.started(delivery.position.partition, delivery.position.offset)
            out.append(delivery)
            count += len(delivery.records)
        return out

    def _report(self) -> None:
        if time.monotonic() - self.reported < self.cfg.buffer.metrics_interval_s:
            return
        self.reported = time.monotonic()
        values = {"teacher_samples": float(self.samples), "teacher_tokens": float(self.tokens),
                  "teacher_score_s": self.score_s,
                  "teacher_tokens_per_s": self.tokens / self.score_s if self.score_s else 0.0}
        self.producer.send(topics.METRICS, [Metrics("teacher", self.samples, time.time(), values)], key="teacher")

    async def run(self, stop: threading.Event) -> None:
        log.info("scoring rollout.trajectories on teacher %s", self.teacher)
        try:
            while not stop.is_set():
                await self.step()
        finally:
            await self.close()

    async def close(self) -> None:
        self.checkpoint.commit()  # waited for: a planned restart redoes nothing
        self.consumer.close()
        close = getattr(self.scorer, "close", None)
        if close is not None:
            await close()


def run_teacher(cfg: Config, stop: threading.Event) -> None:
    configure_process(cfg.model)
    asyncio.run(TeacherStage(cfg).run(stop))
