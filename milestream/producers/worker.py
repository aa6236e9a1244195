"""The asynchronous rollout worker: prompts in, scored trajectories and log-probs out.

Each admitted prompt is one group of ``group_size`` samples (a sample is one trajectory, or an agent's
episode one per leaf of its session, published in one value) and costs one buffer credit, taken once per
group id (streams/ledger.py): a prompt redone after its worker died keeps the credit it holds. With
sample-granular refill (the default) every sample holds one of ``max_inflight_samples`` slots and a
finished sample frees its slot at once; with group-granular refill a group takes all its slots
before it starts and frees them when its last sample ends. Without credit nothing is admitted.
What a group's samples are, how they are generated and scored is the rollout layers' business
(producers/rollout.py: rollout, generate and agent functions, each an import path).

Failures are events, never silence: when the engine or a rollout layer raises, every sample of the group
not yet published is published with status ``error`` and the reason, so the processor drops the group
(reason ``error``), its credit comes back and its prompt offset is committed. ``rollout.max_errors``
failed groups within ``rollout.error_window_s`` stop the worker with exit code 3 and the last error.
Stopped (SIGTERM), a worker admits nothing more, lets its groups finish for ``rollout.stop_grace_s`` and
publishes what is left as ``aborted``.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from milestream.config import Config
from milestream.engines.engine import CpuEngine, Engine, sampling_params
from milestream.engines.moe_routing import routing_records
from milestream.infra import faults
from milestream.infra.kafka import Delivery, RecordConsumer, RecordProducer
from milestream.infra.lifecycle import async_stop, stop_on_signals
from milestream.infra.model import configure_process, load_tokenizer
from milestream.infra.offsets import Checkpoint, HeldOffsets
from milestream.producers.environments.sandbox import figures as sandbox_figures
from milestream.producers.inputs import check_prompt
from milestream.producers.prompt_reader import PromptReader
from milestream.producers.rewards import Reward
from milestream.producers.rollout import GroupTask, RolloutContext, Sample, load_layers
from milestream.schemas import topics
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import LogProbs, Metrics, Prompt, Routing, Trajectory, WeightVersion, trajectory_id
from milestream.streams import weights
from milestream.streams.weights import verify
from milestream.streams.ledger import BEHIND, COMPLETE, NO_CREDIT, READMITTED, BufferLedger

log = logging.getLogger(__name__)
STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}
EXIT_GAVE_UP = 3  # the worker stopped itself: failures persisted (``milestream run`` stops the run)


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


class ErrorWindow:
    """Failed groups over the last ``window_s`` seconds; ``add`` tells when they reach ``limit``."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.times: deque[float] = deque()
        self.total = 0
        self.last = ""

    def add(self, error: str) -> bool:
        now = time.monotonic()
        self.times.append(now)
        self.total += 1
        self.last = error
        while now - self.times[0] > self.window_s:
            self.times.popleft()
        return len(self.times) >= self.limit


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


class RolloutWorker:
    def __init__(self, cfg: Config, worker_id: str, engine: Engine, tokenizer, hook: EngineHook | None = None) -> None:
        self.cfg, self.worker_id, self.engine, self.tokenizer = cfg, worker_id, engine, tokenizer
        self.layers = load_layers(cfg)
        self.ctx = RolloutContext(cfg, worker_id, engine, tokenizer, sampling_params(cfg.rollout, tokenizer),
                                  self._generate_in_slot, self.layers.agent)
        self.producer = RecordProducer(cfg.broker, client_id=f"rollout-{worker_id}")
        self.ledger = BufferLedger(cfg)
        self.prompts = PromptReader(RecordConsumer(cfg.broker, topics.PROMPTS, f"{cfg.broker.topic_prefix}rollout",
                                                   deadletter=self.producer,
                                                   check=functools.partial(check_prompt, cfg)).subscribe())
        self.versions = RecordConsumer(cfg.broker, topics.WEIGHT_VERSIONS, f"rollout-{worker_id}-versions",
                                       deadletter=self.producer,
                                       check=weights.version_check(cfg, self.ledger)).assign(partitions=[0])
        self.offsets: HeldOffsets[int] = HeldOffsets()
        self.checkpoint = Checkpoint(self.producer, self.prompts, self.offsets.committable)
        self.slots = asyncio.Semaphore(cfg.rollout.max_inflight_samples)
        self.group_refill = cfg.rollout.refill == "group"
        self.weights_ready = asyncio.Event()
        self.version_applied = asyncio.Condition()  # notified at each version the engine takes
        self.tasks: set[asyncio.Task] = set()
        self.hook = hook or NoHook()
        self.samples_done = 0
        self.stalled_s = 0.0  # waiting for buffer credit
        self.behind_s = 0.0  # waiting for a newer weight version (the version floor, or async's projection)
        self.log_write_s = 0.0  # encoding and producing records, not yet added to the ledger's log costs
        self.errors = ErrorWindow(cfg.rollout.max_errors, cfg.rollout.error_window_s)
        self.gave_up = ""  # why the worker stopped itself, if it did
        self.waiting_on = "the first weight version"  # what admission waits for now: a stalled worker's log says
        self._stop = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``. A loop of the worker's own that ends first (admission, weights, reports) ends the run
        with its error, so the stage restarts, rather than leaving a member that holds its prompts' partitions
        and admits nothing (an exception in a task is otherwise seen by nobody)."""
        self._stop = stop
        background = [asyncio.create_task(self._follow_weights(stop)), asyncio.create_task(self._report(stop))]
        admit = asyncio.create_task(self._admit_forever())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([stopping, admit, *background], return_when=asyncio.FIRST_COMPLETED)
        ended = [task for task in (admit, *background) if task.done()]
        error = None if stop.is_set() or not ended else (
            ended[0].exception() or RuntimeError(f"the worker's {ended[0].get_coro().__name__} loop ended"))
        if error is not None:
            log.error("worker %s: %r; stopping, for a restart to take over its prompts", self.worker_id, error)
        stopping.cancel()
        admit.cancel()
        if self.tasks and not self.gave_up and error is None:  # scaled in: the groups in flight may finish
            log.info("worker %s stopping: %d groups in flight get %.0f s to finish", self.worker_id, len(self.tasks),
                     self.cfg.rollout.stop_grace_s)
            await asyncio.wait(set(self.tasks), timeout=self.cfg.rollout.stop_grace_s)
        running = list(self.tasks)
        for task in [*background, *running]:
            task.cancel()
        await asyncio.gather(admit, *background, *running, return_exceptions=True)
        log.info("worker %s stopped: %d groups aborted", self.worker_id, len(running))
        self.close()
        if error is not None:
            raise error

    def close(self) -> None:
        self.producer.close()
        self.prompts.close()
        self.versions.close()
        self.hook.close()

    async def _admit_forever(self) -> None:
        await self.weights_ready.wait()
        size = self.cfg.rollout.group_size
        while True:
            group = await self._next_group()
            self.waiting_on = "free slots"
            if self.group_refill:  # the group holds all its slots from start to end
                for _ in range(size):
                    await self.slots.acquire()
            self._spawn(self._run_group(group))
            # sample refill: the next prompt is taken once every sample of this one holds a slot
            await group.task.admitted.wait()

    async def _next_group(self) -> Group:
        """The next prompt, admitted with its credit; a prompt whose group the processor already has (a redo
        after a crash) is passed over."""
        while True:
            self.waiting_on = "a prompt"
            delivery = await self.prompts.next()
            prompt, position = delivery.records[0], delivery.position
            self.offsets.started(position.partition, position.offset)
            admission = await self._admission(prompt.group_id)
            if admission == COMPLETE:
                self._prompt_done(position)
                continue
            if admission == READMITTED:
                log.info("group %s: redone (admitted before by a worker that stopped), with its credit", prompt.group_id)
            return Group(GroupTask(prompt, self.cfg.rollout.group_size), position)

    async def _admission(self, group_id: str) -> str:
        """Waits while there is no credit, or while this engine is older than the version the trainer asks the
        next batch of (run.schedule sync, one_step), or (async) than the version that keeps the group within the
        staleness bound when the trainer will collect it (streams/ledger.py). The log's cost so far goes to the
        ledger first (once a group, with the admission's own round trip: the trainer's step figures)."""
        self.ledger.add_log_costs({"rollout_encode_s": self.log_write_s})
        self.log_write_s = 0.0
        while True:
            version = self.engine.version
            faults.fail("worker.admitting")
            admission = self.ledger.admit(group_id, self.worker_id, version)
            if admission not in (NO_CREDIT, BEHIND):
                return admission
            started = time.monotonic()
            self.waiting_on = f"{admission} for group {group_id} (engine at version {version})"
            if admission == NO_CREDIT:
                await asyncio.sleep(0.1)
                self.stalled_s += time.monotonic() - started
            else:  # only a newer version in this engine can change the answer: wait for it, not on a clock
                await self._newer_than(version, timeout_s=1.0)
                self.behind_s += time.monotonic() - started

    async def _newer_than(self, version: int, timeout_s: float) -> None:
        async with self.version_applied:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.version_applied.wait_for(lambda: self.engine.version > version),
                                       timeout_s)

    def _prompt_done(self, position: Position) -> None:
        """The prompt's offset committed once its group's samples are on the log."""
        self.offsets.done(position.partition, position.offset)
        started = time.perf_counter()
        self.checkpoint.commit(wait=False)
        self.log_write_s += time.perf_counter() - started

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sample task failed", exc_info=task.exception())

    async def _run_group(self, group: Group) -> None:
        """The rollout function's samples of one group, each published as it comes; a failure or a stop
        publishes the rest as errors or aborted. Either way the group is whole on the log, and its prompt done."""
        published: set[int] = set()
        try:
            async for index, sample, reward in self.layers.rollout(self.ctx, group.task):
                self._publish(group, index, sample, reward)
                published.add(index)
                self.samples_done += 1
                faults.hold("worker.sample_published")
        except asyncio.CancelledError:  # stopped, past rollout.stop_grace_s
            self._publish_unfinished(group, published, "aborted", f"worker {self.worker_id} stopped")
            self._group_done(group)
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's or a plug-in's failure becomes the group's record
            error = describe(exc)
            log.error("group %s failed: %s", group.group_id, error, exc_info=exc)  # the traceback, once per group
            self._publish_unfinished(group, published, "error", error)
            if self.errors.add(error):
                self._give_up()
        self._group_done(group)

    def _group_done(self, group: Group) -> None:
        group.task.admitted.set()
        if self.group_refill:
            for _ in range(group.task.size):
                self.slots.release()
        self._prompt_done(group.position)

    def _give_up(self) -> None:
        window = self.errors
        self.gave_up = (f"rollout worker {self.worker_id} stops: {len(window.times)} failed groups within "
                        f"{window.window_s:.0f} s (rollout.max_errors {window.limit}, rollout.error_window_s); "
                        f"the last error: {window.last}")
        log.error("%s", self.gave_up)
        self._stop.set()

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
        """A sample's trajectories (one, or an agent's episode with its branches: each leaf, the episode's
        reward) as one value on each topic, so a sample is on the log whole or not at all."""
        scored = reward if isinstance(reward, Reward) else Reward(reward)
        leaves = (sample, *sample.branches)
        records = []
        for number, leaf in enumerate(leaves):
            routing = routing_records(trajectory_id(group.group_id, index, number), group.group_id, index,
                                      group.task.size, leaf.routing)
            trajectory = self._trajectory(
                group, index, number, leaves=len(leaves), prompt_ids=leaf.prompt_ids, response_ids=leaf.response_ids,
                loss_mask=leaf.loss_mask, token_versions=leaf.versions, reward=scored.value,
                status=STATUS[leaf.finish_reason], reward_error=scored.error, routing_chunks=len(routing),
                response_text=self.tokenizer.decode(leaf.response_ids, skip_special_tokens=True))
            records.append((trajectory, self._logprobs(trajectory, leaf.logprobs, leaf.topk_ids, leaf.topk_logprobs),
                            routing))
        self._send(group, records)

    def _publish_unfinished(self, group: Group, published: set[int], status: str, reason: str) -> None:
        """The samples of ``group`` not published yet, as empty ``status`` records saying why."""
        for index in sorted(set(range(group.task.size)) - published):
            trajectory = self._trajectory(group, index, 0, prompt_ids=[], response_ids=[], loss_mask=[],
                                          token_versions=[], reward=0.0, status=status, response_text="", error=reason)
            self._send(group, [(trajectory, self._logprobs(trajectory, []), [])])

    def _trajectory(self, group: Group, index: int, leaf: int, **fields) -> Trajectory:
        return Trajectory(trajectory_id=trajectory_id(group.group_id, index, leaf), group_id=group.group_id,
                          prompt_id=group.prompt.prompt_id, sample_index=index, group_size=group.task.size,
                          engine_id=self.worker_id, worker_id=self.worker_id, submitted_at=group.submitted_at,
                          finished_at=time.time(), leaf=leaf, **fields)

    @staticmethod
    def _logprobs(trajectory: Trajectory, logprobs: list[float], *topk: list[list] | None) -> LogProbs:
        return LogProbs(trajectory.trajectory_id, trajectory.group_id, trajectory.sample_index, trajectory.group_size,
                        logprobs, *topk)

    def _send(self, group: Group, records: list[tuple[Trajectory, LogProbs, list[Routing]]]) -> None:
        started = time.perf_counter()
        self.producer.send(topics.TRAJECTORIES, [trajectory for trajectory, _, _ in records], key=group.group_id)
        self.producer.send(topics.LOGPROBS, [logprobs for _, logprobs, _ in records], key=group.group_id)
        for _, _, routing in records:
            for chunk in routing:  # a message each: chunking keeps every message under the broker's limit
                self.producer.send(topics.ROUTING, [chunk], key=group.group_id)
        self.log_write_s += time.perf_counter() - started

    async def _follow_weights(self, stop: asyncio.Event) -> None:
        """Apply each newer announced version (only the newest, unless the transport needs every one);
        nothing is admitted before the first pass, nor before the noise check's first version."""
        receiver = await asyncio.to_thread(weights.make_receiver, self.cfg, self.worker_id)
        noise = await self._fill_noise() if self.cfg.weights.noise_check else None
        first_pass = True
        try:
            while not stop.is_set():
                # the first pass reads every version announced so far, however slow the reader is to start
                read = functools.partial(self.versions.drain_to_end, 0) if first_pass else \
                    functools.partial(self.versions.drain, 0.5, 5.0)
                deliveries = await asyncio.to_thread(read)
                first_pass = False
                newer = sorted(((r, d) for d in deliveries for r in d.records
                                if r.version > self.engine.version or (noise and noise.pending)),
                               key=lambda pair: pair[0].version)
                if receiver.every_version:
                    for record, delivery in newer:
                        await self._apply(receiver, record, delivery, noise)
                else:  # the newest this engine can take: one refused is passed over for the one before
                    for record, delivery in reversed(newer):
                        if await self._apply(receiver, record, delivery, noise):
                            break
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

    async def _apply(self, receiver: weights.WeightReceiver, record: WeightVersion, delivery: Delivery,
                     noise: verify.NoiseCheck | None) -> bool:
        """Receive (decode, apply, verify) off the loop while the engine generates; pause only to load. A
        version refused is acknowledged as such, and dead-lettered: its announcement does not hold."""
        try:
            tensors = await asyncio.to_thread(receiver.receive, record)
            await self.engine.update_weights(record.version, tensors)
            if noise is not None and noise.pending:
                await asyncio.to_thread(noise.compare, record.version, tensors)
        except weights.VersionPruned as exc:  # the trainer moved on while this engine (re)started
            log.info("weight version %d passed over: %s", record.version, exc)
            return False
        except (weights.WeightVerificationError, OSError, ValueError) as exc:
            log.error("weight version %d rejected: %s", record.version, exc)
            weights.acknowledge(self.producer, self.worker_id, record, None, error=str(exc))
            field = "checksums" if isinstance(exc, weights.WeightVerificationError) else "location"
            self.producer.dead_letter(delivery.position, RecordError(delivery.position, field, str(exc)),
                                      delivery.key, delivery.value)
            return False
        weights.acknowledge(self.producer, self.worker_id, record, tensors)
        log.info("engine %s now at weight version %d", self.worker_id, record.version)
        async with self.version_applied:
            self.version_applied.notify_all()
        await self.hook.after_version(self.engine, record.version, record.step)
        return True

    async def _report(self, stop: asyncio.Event, interval_s: float = 5.0, quiet_s: float = 30.0) -> None:
        """The worker's figures on ``metrics`` every ``interval_s``; in its log, what it waits for once it has
        published no sample for ``quiet_s`` (a stalled run's first question: is it credit, a prompt, a version?)."""
        started = last_sample_at = time.monotonic()
        last_samples = 0
        while not stop.is_set():
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            elapsed = now - started
            if self.samples_done != last_samples:
                last_samples, last_sample_at = self.samples_done, now
            elif now - last_sample_at >= quiet_s:
                log.info("worker %s: no sample for %.0f s, %d groups in flight; admission waits for %s (%d prompts "
                         "read so far, from partitions %s of prompts)", self.worker_id, now - last_sample_at,
                         len(self.tasks), self.waiting_on, self.prompts.taken, sorted(self.prompts.consumer.owned))
                last_sample_at = now
            values = {"samples": float(self.samples_done), "samples_per_s": self.samples_done / elapsed,
                      "inflight": float(len(self.tasks)), "stalled_s": self.stalled_s,
                      "behind_s": self.behind_s,
                      "engine_version": float(self.engine.version),
                      "update_pause_s": float(getattr(self.engine, "update_pause_s", 0.0)),
                      "engine_busy_s": float(getattr(self.engine, "busy_s", 0.0)),  # CpuEngine
                      "failed_groups": float(self.errors.total), "failed_groups_in_window": float(len(self.errors.times)),
                      **self.ctx.reward_figures.take(), **sandbox_figures()}
            self.producer.send(topics.METRICS, [Metrics(f"rollout/{self.worker_id}", int(elapsed), time.time(), values)])


def make_engine(cfg: Config, worker_id: str) -> Engine:
    """An in-process CpuEngine, or (``rollout.engine_url``) engines behind SGLang's HTTP API: one
    engine server, milestream's router, or SGLang servers behind it; weight versions reach them as
    disk files this worker stages under the run folder; or (``rollout.engine: vllm``) a vLLM server."""
    if cfg.rollout.engine == "vllm":
        from milestream.engines.vllm import vllm_engine

        return vllm_engine(cfg, worker_id)
    if cfg.rollout.engine_url:
        from milestream.engines.http_engine import ROUTER_REPLY_MARGIN_S, HttpEngine
        from milestream.infra.secret_env import control_token
        from milestream.streams.weights.base import engine_weights_dir

        # past the router's own timeout, so the router's answer (which names the engine that failed) comes first
        return HttpEngine(cfg.rollout.engine_url, weights_dir=engine_weights_dir(cfg.run_path) / worker_id,
                          key_header=cfg.router.key_header, model=cfg.model, token=control_token(cfg).value,
                          timeout_s=cfg.router.request_timeout_s + ROUTER_REPLY_MARGIN_S)
    seed = cfg.model.seed * 1000 + zlib.crc32(worker_id.encode()) % 1000
    return CpuEngine(cfg.model, cfg.rollout, seed=seed, inflight=cfg.weights.inflight)


def run_worker(cfg: Config, worker_id: str, hook: EngineHook | None = None) -> None:
    stop = stop_on_signals()
    configure_process(cfg.model)
    engine = make_engine(cfg, worker_id)
    worker = RolloutWorker(cfg, worker_id, engine, load_tokenizer(cfg.model), hook)

    async def main() -> None:
        await worker.run(async_stop(stop))
        await engine.close()

    asyncio.run(main())
    if worker.gave_up:
        sys.exit(EXIT_GAVE_UP)
