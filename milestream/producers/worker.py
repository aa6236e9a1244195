"""The asynchronous rollout worker: prompts in, scored trajectories and log-probs out.

Each admitted prompt is one group of ``group_size`` samples and costs one buffer credit. With
sample-granular refill (the default) every sample holds one of ``max_inflight_samples`` slots and a
finished sample frees its slot at once; with group-granular refill a group takes all its slots
before it starts and frees them when its last sample ends. Without credit nothing is admitted.
What a group's samples are, how they are generated and scored is the rollout layers' business
(producers/rollout.py: rollout, generate and agent functions, each an import path).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

from milestream.config import Config
from milestream.engines.engine import CpuEngine, Engine, sampling_params
from milestream.engines.moe_routing import routing_records
from milestream.infra import faults
from milestream.infra.kafka import RecordConsumer, RecordProducer
from milestream.infra.model import configure_process, load_tokenizer
from milestream.infra.offsets import HeldOffsets
from milestream.producers.rewards import Reward
from milestream.producers.rollout import GroupTask, RolloutContext, Sample, load_layers
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import LogProbs, Metrics, Prompt, Trajectory, WeightVersion
from milestream.streams import weights
from milestream.streams.weights import verify
from milestream.streams.ledger import BufferLedger

log = logging.getLogger(__name__)
STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}


@dataclass
class Group:
    task: GroupTask
    position: Position
    submitted_at: float = field(default_factory=time.time)

    @property
    def prompt(self) -> Prompt:
        return self.task.prompt

    @property
    def group_id(self) -> str:
        return self.task.prompt.group_id


class EngineHook(Protocol):
    """Work that shares this worker's engine between submissions (``eval.mode: shared`` evaluation):
    injected by whoever starts the worker, so rollout never imports the consumers built on top of it."""

    async def admission(self) -> None:
        """Returns when a new submission may start."""

    async def after_version(self, engine: Engine, version: int, step: int) -> None:
        """Called once the engine has applied ``version``, and with version 0 (step 0) when it starts on the
        initial weights, before it admits any prompt."""

    def close(self) -> None: ...


class NoHook:
    async def admission(self) -> None:
        return None

    async def after_version(self, engine: Engine, version: int, step: int) -> None:
        return None

    def close(self) -> None:
        return None


class RolloutWorker:
    def __init__(self, cfg: Config, worker_id: str, engine: Engine, tokenizer, hook: EngineHook | None = None) -> None:
        self.cfg, self.worker_id, self.engine, self.tokenizer = cfg, worker_id, engine, tokenizer
        self.layers = load_layers(cfg)
        self.ctx = RolloutContext(cfg, worker_id, engine, tokenizer, sampling_params(cfg.rollout, tokenizer),
                                  self._generate_in_slot, self.layers.agent)
        self.producer = RecordProducer(cfg.broker, client_id=f"rollout-{worker_id}")
        self.prompts = RecordConsumer(cfg.broker, topics.PROMPTS, f"{cfg.broker.topic_prefix}rollout",
                                      deadletter=self.producer).subscribe()
        self.versions = RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, f"rollout-{worker_id}-versions",
                                       deadletter=self.producer).assign(partitions=[0])
        self.ledger = BufferLedger(cfg)
        self.offsets: HeldOffsets[int] = HeldOffsets()
        self.slots = asyncio.Semaphore(cfg.rollout.max_inflight_samples)
        self.group_refill = cfg.rollout.refill == "group"
        self.weights_ready = asyncio.Event()
        self.tasks: set[asyncio.Task] = set()
        self.hook = hook or NoHook()
        self.samples_done = 0
        self.stalled_s = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        background = [asyncio.create_task(self._follow_weights(stop)), asyncio.create_task(self._report(stop))]
        admit = asyncio.create_task(self._admit_forever())
        await stop.wait()
        admit.cancel()
        for task in [*background, *self.tasks]:
            task.cancel()
        await asyncio.gather(admit, *background, *self.tasks, return_exceptions=True)
        self.producer.flush()
        self.prompts.close()
        self.versions.close()
        self.hook.close()

    async def _admit_forever(self) -> None:
        await self.weights_ready.wait()
        size = self.cfg.rollout.group_size
        while True:
            group = await self._next_group()
            if self.group_refill:  # the group holds all its slots from start to end
                for _ in range(size):
                    await self.slots.acquire()
            self._spawn(self._run_group(group))
            # sample refill: the next prompt is taken once every sample of this one holds a slot
            await group.task.admitted.wait()

    async def _next_group(self) -> Group:
        """Wait for a credit, then for a prompt; the credit is returned if no prompt comes."""
        while True:
            if not self.ledger.try_take():
                started = time.monotonic()
                await asyncio.sleep(0.1)
                self.stalled_s += time.monotonic() - started
                continue
            try:
                delivery = await asyncio.to_thread(self.prompts.poll, 0.5)
            except asyncio.CancelledError:  # stopped while waiting for a prompt: the credit was not used
                self.ledger.give_back()
                raise
            if delivery is None:
                self.ledger.give_back()
                continue
            prompt = delivery.records[0]
            self.ledger.prompt_admitted()
            self.offsets.started(delivery.position.partition, delivery.position.offset)
            return Group(GroupTask(prompt, self.cfg.rollout.group_size), delivery.position)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sample task failed", exc_info=task.exception())

    async def _run_group(self, group: Group) -> None:
        """The rollout function's samples of one group, each published as it comes."""
        try:
            async for index, sample, reward in self.layers.rollout(self.ctx, group.task):
                self._publish(group, index, sample, reward)
                self.samples_done += 1
                faults.hold("worker.sample_published")
        finally:
            group.task.admitted.set()
            if self.group_refill:
                for _ in range(group.task.size):
                    self.slots.release()
        self.producer.flush()
        self.offsets.done(group.position.partition, group.position.offset)
        self.prompts.commit(self.offsets.committable())

    async def _generate_in_slot(self, task: GroupTask, index: int) -> Sample:
        """``ctx.generate``: the generate function, holding one of ``max_inflight_samples`` slots."""
        if not self.group_refill:
            await self.slots.acquire()
        task.slots_taken += 1
        if task.slots_taken >= task.size:
            task.admitted.set()
        try:
            await self.hook.admission()  # e.g. a shared evaluation running on this engine
            return await self.layers.generate(self.ctx, task.prompt, f"{task.prompt.group_id}/{index}")
        finally:
            if not self.group_refill:
                self.slots.release()

    def _publish(self, group: Group, index: int, sample: Sample, reward: float | Reward) -> None:
        scored = reward if isinstance(reward, Reward) else Reward(reward)
        size = group.task.size
        routing = routing_records(f"{group.group_id}/{index}", group.group_id, index, size, sample.routing)
        trajectory = Trajectory(
            trajectory_id=f"{group.group_id}/{index}", group_id=group.group_id, prompt_id=group.prompt.prompt_id,
            sample_index=index, group_size=size, prompt_ids=sample.prompt_ids, response_ids=sample.response_ids,
            loss_mask=sample.loss_mask, token_versions=sample.versions, reward=scored.value,
            status=STATUS[sample.finish_reason],
            response_text=self.tokenizer.decode(sample.response_ids, skip_special_tokens=True),
            engine_id=self.worker_id, worker_id=self.worker_id, submitted_at=group.submitted_at,
            finished_at=time.time(), routing_chunks=len(routing), reward_error=scored.error,
        )
        logprobs = LogProbs(trajectory.trajectory_id, group.group_id, index, size, sample.logprobs)
        self.producer.send(topics.TRAJECTORIES, [trajectory], key=group.group_id)
        self.producer.send(topics.LOGPROBS, [logprobs], key=group.group_id)
        for chunk in routing:  # a message each: chunking keeps every message under the broker's limit
            self.producer.send(topics.ROUTING, [chunk], key=group.group_id)

    async def _follow_weights(self, stop: asyncio.Event) -> None:
        """Apply each newer announced version (only the newest, unless the transport needs every one);
        nothing is admitted before the first pass, nor before the noise check's first version."""
        receiver = await asyncio.to_thread(weights.make_receiver, self.cfg, self.worker_id)
        noise = await self._fill_noise() if self.cfg.weights.noise_check else None
        try:
            while not stop.is_set():
                deliveries = await asyncio.to_thread(self.versions.drain, 0.5, 5.0)
                newer = sorted((r for d in deliveries for r in d.records
                                if r.version > self.engine.version or (noise and noise.pending)),
                               key=lambda r: r.version)
                for record in newer if receiver.every_version else newer[-1:]:
                    await self._apply(receiver, record, noise)
                if noise is None or not noise.pending:
                    if not self.weights_ready.is_set() and self.engine.version == 0:
                        await self.hook.after_version(self.engine, 0, 0)
                    self.weights_ready.set()
        except Exception:
            log.exception("engine %s stopped following weight versions", self.worker_id)  # never silently stale
            raise
        finally:
            receiver.close()

    async def _fill_noise(self) -> verify.NoiseCheck:
        model = getattr(self.engine, "model", None)
        if model is None:
            raise ValueError("weights.noise_check needs an engine that exposes its model (CpuEngine)")
        noise = verify.NoiseCheck(model, seed=zlib.crc32(self.worker_id.encode()))
        await self.engine.pause()
        try:
            await asyncio.to_thread(noise.fill)
        finally:
            await self.engine.resume()
        log.info("engine %s filled with noise until its first weight version", self.worker_id)
        return noise

    async def _apply(self, receiver: weights.WeightReceiver, record: WeightVersion,
                     noise: verify.NoiseCheck | None) -> None:
        """Receive (decode, apply, verify) off the loop while the engine generates; pause only to load."""
        try:
            tensors = await asyncio.to_thread(receiver.receive, record)
            await self.engine.update_weights(record.version, tensors)
            if noise is not None and noise.pending:
                await asyncio.to_thread(noise.compare, record.version, tensors)
        except (weights.WeightVerificationError, OSError, ValueError) as exc:
            log.error("weight version %d rejected: %s", record.version, exc)
            weights.acknowledge(self.producer, self.worker_id, record, None, error=str(exc))
            return
        weights.acknowledge(self.producer, self.worker_id, record, tensors)
        log.info("engine %s now at weight version %d", self.worker_id, record.version)
        await self.hook.after_version(self.engine, record.version, record.step)

    async def _report(self, stop: asyncio.Event, interval_s: float = 5.0) -> None:
        started = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(interval_s)
            elapsed = time.monotonic() - started
            values = {"samples": float(self.samples_done), "samples_per_s": self.samples_done / elapsed,
                      "inflight": float(len(self.tasks)), "stalled_s": self.stalled_s,
                      "engine_version": float(self.engine.version),
                      "update_pause_s": float(getattr(self.engine, "update_pause_s", 0.0)),
                      **self.ctx.reward_figures.take()}
            self.producer.send(topics.METRICS, [Metrics(f"rollout/{self.worker_id}", int(elapsed), time.time(), values)])


def make_engine(cfg: Config, worker_id: str) -> Engine:
    """An in-process CpuEngine, or (``rollout.engine_url``) engines behind SGLang's HTTP API: one
    engine server, milestream's router, or SGLang servers behind it; weight versions reach them as
    disk files this worker stages under the run folder."""
    if cfg.rollout.engine_url:
        from milestream.engines.http_engine import HttpEngine

        return HttpEngine(cfg.rollout.engine_url, weights_dir=cfg.run_path / "engine-weights" / worker_id,
                          key_header=cfg.router.key_header, model=cfg.model)
    seed = cfg.model.seed * 1000 + zlib.crc32(worker_id.encode()) % 1000
    return CpuEngine(cfg.model, cfg.rollout, seed=seed, inflight=cfg.weights.inflight)


def run_worker(cfg: Config, worker_id: str, hook: EngineHook | None = None) -> None:
    configure_process(cfg.model)
    engine = make_engine(cfg, worker_id)
    worker = RolloutWorker(cfg, worker_id, engine, load_tokenizer(cfg.model), hook)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await worker.run(stop)
        await engine.close()

    asyncio.run(main())
