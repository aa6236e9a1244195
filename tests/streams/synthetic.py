"""Helpers for the stream-processor tests: synthetic complete groups, admitted as a rollout worker admits
them (the processor takes records of admitted groups only), and the processor as a process.

The processor runs as ``python -m milestream.cli process`` (as in ``milestream run``), so a test can
SIGKILL it exactly as an operator's crash would, and its log is kept for the failure message.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from milestream.config import Config
from milestream.infra.kafka import RecordConsumer
from milestream.infra.services import die_with_parent
from milestream.schemas import topics
from milestream.schemas import routing
from milestream.schemas.records import LogProbs, Record, Trajectory
from milestream.streams.ledger import ADMITTED, BufferLedger

NUM_EXPERTS, ROUTING_LAYERS, TOP_K, ROUTING_CHUNK_TOKENS = 16, 3, 2, 3

Published = tuple[topics.TopicSpec, Record]


def trajectory(group_id: str, index: int, group_size: int, response_tokens: int = 4,
               routing_chunks: int = 0) -> Trajectory:
    return Trajectory(f"{group_id}/{index}", group_id, f"prompt-{group_id}", index, group_size, [1, 2, 3],
                      list(range(10, 10 + response_tokens)), [1] * response_tokens, [0] * response_tokens,
                      float(index), "completed", "", "synthetic", "synthetic", 0.0, 0.0, routing_chunks)


def expert_ids(group_id: str, index: int, tokens: int) -> np.ndarray:
    """A trajectory's routing, derived from its id so a reader can recompute what was sent; each
    token's ids sorted, as the wire keeps them (schemas/routing.py)."""
    seed = zlib.crc32(f"{group_id}/{index}".encode())
    return np.sort(np.random.default_rng(seed).integers(0, NUM_EXPERTS, size=(tokens, ROUTING_LAYERS, TOP_K)), axis=2)


def routing_records(group_id: str, index: int, group_size: int, tokens: int) -> list[Record]:
    return routing.pack(f"{group_id}/{index}", group_id, index, group_size, expert_ids(group_id, index, tokens),
                        NUM_EXPERTS, chunk_tokens=ROUTING_CHUNK_TOKENS)


def logprobs(group_id: str, index: int, group_size: int, response_tokens: int = 4) -> LogProbs:
    return LogProbs(f"{group_id}/{index}", group_id, index, group_size, [-0.5] * response_tokens)


def group_records(group_id: str, group_size: int, with_routing: bool = False) -> list[Published]:
    """Every record of one complete group: G trajectories, G log-probs and, with routing, its chunks."""
    tokens = 4  # the response length of trajectory(); the prompt's routing is not replayed
    chunks = -(-tokens // ROUTING_CHUNK_TOKENS) if with_routing else 0
    out: list[Published] = [(topics.TRAJECTORIES, trajectory(group_id, i, group_size, tokens, chunks))
                            for i in range(group_size)]
    out += [(topics.LOGPROBS, logprobs(group_id, i, group_size, tokens)) for i in range(group_size)]
    if with_routing:
        out += [(topics.ROUTING, r) for i in range(group_size) for r in routing_records(group_id, i, group_size, tokens)]
    return out


def with_credit(cfg: Config, groups: int) -> Config:
    """``cfg`` with a buffer ledger of its own (its own Redis key prefix) whose credit admits ``groups`` groups."""
    wide = cfg.with_overrides(redis={"key_prefix": f"{cfg.redis.key_prefix}-{groups}"},
                              buffer={"capacity_factor": max(groups / cfg.trainer.batch_groups, 1.0)})
    BufferLedger(wide).initialise()
    return wide


def admit(cfg: Config, group_ids) -> None:
    """Admit each group as a rollout worker does before it publishes the group's records (one credit each), on an
    engine at the trainer's version (the records' own versions are what a test makes stale or fresh)."""
    ledger = BufferLedger(cfg)
    engine_version = ledger.trainer_version() or 0
    for group_id in group_ids:
        assert ledger.admit(group_id, "synthetic", engine_version) == ADMITTED, f"no credit left for {group_id}"


class ProcessorProcess:
    """The stream processor as its own OS process, restartable; every life appends to one log."""

    def __init__(self, cfg: Config, workdir: Path):
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "processor.yaml"
        self.config_path.write_text(cfg.to_yaml())
        self.log_path = workdir / "processor.log"
        self.proc: subprocess.Popen | None = None
        self.lives = 0

    def start(self) -> None:
        self.lives += 1
        with open(self.log_path, "a") as log:
            log.write(f"==== life {self.lives}\n")
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "milestream.cli", "process", "--config", str(self.config_path),
                 "--log-level", "WARNING"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, no final commit, no producer flush."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def assert_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"processor exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def all_partitions(cfg: Config, spec: topics.TopicSpec) -> range:
    return range(cfg.broker.partitions if spec.keyed_partitions else 1)


def topic_reader(cfg: Config, spec: topics.TopicSpec) -> RecordConsumer:
    """A consumer of every partition of ``spec`` from the beginning (no group membership, no commits)."""
    return RecordConsumer(cfg.broker, spec, f"reader-{time.time()}").assign(partitions=all_partitions(cfg, spec))


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Wait for a condition with a generous deadline; the deadline is a hang guard, not a speed assert."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)
