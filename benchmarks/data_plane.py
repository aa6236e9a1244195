"""Data-plane throughput and latency: rollout records -> stream processor(s) -> trainer-ready groups.

Prints one JSON line per size (and a last one with all of them), each on a fresh embedded broker:
  1k          G = 8 trajectories of 64 + 1024 tokens with their log-probs, no routing
  32k         G = 8 of 512 + 32768 tokens with log-probs
  32k-r3-g8   the same with R3 routing of a 60-layer top-8 model of 256 experts (schemas/routing.py's
  32k-r3-g16  encoding, ~12 MB a trajectory), G = 8 and G = 16

  raw_mb_s       the same encoded values produced (librdkafka's batching, RecordProducer) and consumed
                 (consume(num_messages)) with the same client library in the same run: the better of one
                 after the other and both at once (raw_sequential_mb_s, raw_concurrent_mb_s)
  pipeline_mb_s  payload MB from the first publish to the last group trainer-ready with one processor: its
  traj_s         manifest read, its records read where the manifest says, checked and joined into samples
                 by the trainer's own collector (train/collector.py, batches of ``batch`` groups)
  ratio          pipeline_mb_s / raw_mb_s
  p50_ms/p99_ms  a group's last record published -> the group trainer-ready, one group at a time, paced
  processor_traj_s  the same burst to the last manifest emitted (its CreateTime): the processor's own rate
  scaling        traj/s (trainer-ready, and emitted) with 1, 2 and 4 processor processes (one consumer group,
                 4 partitions)
  copy_ratio     every value forwarded once more to a second topic and read back (the processor's client, no
                 logic): the least a design that copies payloads (chunked groups) costs, against raw
  faust_forward_traj_s  (1k and 32k-r3-g8) the same copy by the cheapest faust-streaming processor
  faust_forward_ratio   (benchmarks/faust_forward.py, its own process: raw values taken in batches, each sent on
                 with its key and headers by faust's producer, no logic): trajectories/s from the first publish
                 to the last copy read back, and its MB/s against raw as copy_ratio's

    .venv/bin/python benchmarks/data_plane.py [--sizes 1k,32k,32k-r3-g8,32k-r3-g16] [--scale 1.0]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterator

import faust_forward  # benchmarks/ is a folder of scripts: this one's own folder is on the path
import numpy as np

from milestream.config import Config
from milestream.infra.kafka import Admin, RawConsumer, RecordConsumer, RecordProducer, SourceConsumer, topic_name
from milestream.infra.secret_env import stage_environment
from milestream.infra.services import die_with_parent, services
from milestream.schemas import routing, topics
from milestream.schemas.codec import encode, headers_for
from milestream.schemas.records import LogProbs, Routing, Trajectory
from milestream.streams.groups import source_topics
from milestream.streams.ledger import BufferLedger
from milestream.streams.processor import BATCH
from milestream.train.collector import GroupCollector

RAW = topics.TopicSpec("bench.raw", Trajectory, "group id", max_message_mb=64)
COPY = topics.TopicSpec("bench.copy", Trajectory, "group id", max_message_mb=64)
VOCAB, PARTITIONS = 49152, 4
SOURCES = source_topics(teacher=False)


@dataclass(frozen=True)
class Size:
    group_size: int
    prompt: int
    response: int
    r3: bool
    groups: int  # in the burst
    paced: int  # groups for the latency
    batch: int  # groups the trainer takes at once
    scaling: tuple[int, ...] = (1,)


SIZES = {
    "1k": Size(8, 64, 1024, False, 400, 60, 8, (1, 2, 4)),
    "32k": Size(8, 512, 32768, False, 40, 10, 4),
    "32k-r3-g8": Size(8, 512, 32768, True, 6, 4, 1),
    "32k-r3-g16": Size(16, 512, 32768, True, 3, 3, 1),
}
FAUST_SIZES = ("1k", "32k-r3-g8")  # where copy_run also runs the faust forwarder
Value = tuple[topics.TopicSpec, bytes]
Group = tuple[str, list[Value]]


def r3_template(tokens: int, rng: np.random.Generator) -> list[Routing]:
    """One trajectory's routing chunks for a 60-layer top-8 model of 256 experts (distinct ids per token and
    layer), packed by the project's encoder; shared by every trajectory (each its own records)."""
    gaps = rng.integers(1, 32, size=(tokens, 60, 8), dtype=np.int64)
    ids = (rng.integers(0, 256, size=(tokens, 60, 1)) + np.cumsum(gaps, axis=2)) % 256
    return routing.pack("t/0", "t", 0, 1, ids, 256)


class Groups:
    """Groups of one size: distinct ids, token lists and routing shared (so making them costs little)."""

    def __init__(self, size: Size, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.size = size
        self.prompt = rng.integers(0, VOCAB, size.prompt).tolist()
        self.responses = [rng.integers(0, VOCAB, size.response).tolist() for _ in range(size.group_size)]
        self.logprobs = [(-rng.random(size.response)).astype(np.float32).tolist() for _ in range(size.group_size)]
        self.routing = r3_template(size.prompt + size.response - 1, rng) if size.r3 else []

    def make(self, group_id: str) -> Group:
        size, values = self.size, []
        for i, response in enumerate(self.responses):
            sample_id, n = f"{group_id}/{i}", len(response)
            values.append((topics.TRAJECTORIES, encode([Trajectory(
                sample_id, group_id, group_id, i, size.group_size, self.prompt, response, [1] * n, [0] * n,
                float(i % 2), "completed", "", "bench", "bench", 0.0, 0.0, len(self.routing))])))
            values.append((topics.LOGPROBS, encode([LogProbs(sample_id, group_id, i, size.group_size,
                                                             self.logprobs[i])])))
            values += [(topics.ROUTING, encode([dataclasses.replace(c, trajectory_id=sample_id, group_id=group_id,
                                                                   sample_index=i, group_size=size.group_size)]))
                       for c in self.routing]
        return group_id, values

    def many(self, prefix: str, count: int) -> list[Group]:
        return [self.make(f"{prefix}-{i}#0") for i in range(count)]


def megabytes(groups: list[Group]) -> float:
    return sum(len(v) for _, values in groups for _, v in values) / 1e6


def publish(producer: RecordProducer, groups: list[Group], spec: topics.TopicSpec | None = None) -> None:
    for group_id, values in groups:
        for source, value in values:
            producer.send_raw(spec or source, value, group_id, headers_for((spec or source).record))
    producer.flush()


def namespace(live: Config, name: str, size: Size) -> Config:
    """A run of its own on the broker: topics, consumer groups and ledger (every group admitted)."""
    cfg = live.with_overrides(broker={"topic_prefix": f"bench-{name}.", "partitions": PARTITIONS},
                              buffer={"capacity_factor": 1e6, "metrics_interval_s": 0.5},
                              rollout={"group_size": size.group_size}, model={"name": "tiny-random"})
    Admin(cfg.broker).create_topics([*topics.CATALOGUE, RAW, COPY])
    BufferLedger(cfg).initialise()
    return cfg


def admit(cfg: Config, groups: list[Group]) -> None:
    """Admit the groups as a rollout worker would: the processor takes records of admitted groups only."""
    ledger = BufferLedger(cfg)
    for group_id, _ in groups:
        ledger.admit(group_id, "bench", 0)


def start_processor(cfg: Config, workdir: Path) -> subprocess.Popen:
    config_path = workdir / f"{cfg.broker.topic_prefix}config.yaml"
    config_path.write_text(cfg.to_yaml())  # without the Redis password: the stage gets it in its environment
    return subprocess.Popen([sys.executable, "-m", "milestream.cli", "process", "--config", str(config_path),
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=stage_environment(cfg), preexec_fn=die_with_parent)


def wait_members(cfg: Config, members: int, timeout_s: float = 120.0) -> None:
    """Until ``members`` processors own every source partition between them (their metrics say which)."""
    reader = RecordConsumer(cfg.broker, topics.METRICS, f"bench-members-{time.time()}").assign(partitions=[0])
    owned: dict[float, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not (len(owned) == members and all(owned.values())
                   and sum(owned.values()) == len(SOURCES) * PARTITIONS + 1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processors never shared the partitions: {owned}")
            if (delivery := reader.poll(0.5)) is not None:
                for record in delivery.records:
                    if record.source == "processor":
                        owned[record.values["member_pid"]] = record.values["owned_partitions"]
    finally:
        reader.close()


def raw_run(cfg: Config, warmup: Group, groups: list[Group], concurrent: bool) -> float:
    """Seconds to produce ``groups``' values onto one topic and consume them all back (client connections and the
    consumer's first fetch made beforehand, on ``warmup``, as the pipeline's are)."""
    consumer = RawConsumer(cfg.broker, f"bench-raw-{time.time()}").assign(
        {(topic_name(cfg.broker, RAW), p): None for p in range(PARTITIONS)})
    producer = RecordProducer(cfg.broker, client_id="bench-raw")
    publish(producer, [warmup], RAW)
    received = [-len(warmup[1])]
    total = sum(len(values) for _, values in groups)
    while received[0] < 0:
        received[0] += len(consumer.consume(timeout=1.0, limit=BATCH))

    def consume() -> None:
        while received[0] < total:
            received[0] += len(consumer.consume(timeout=1.0, limit=BATCH))

    started = time.monotonic()
    reader = threading.Thread(target=consume)
    if concurrent:
        reader.start()
    publish(producer, groups, RAW)
    if not concurrent:
        reader.start()
    reader.join()
    elapsed = time.monotonic() - started
    consumer.close()
    return elapsed


def trainer(cfg: Config) -> GroupCollector:
    """The trainer's collector: groups are ready when it has read their records, checked and joined them."""
    collector = GroupCollector(cfg, RecordProducer(cfg.broker, client_id="bench-trainer"), {},
                               Admin(cfg.broker).partitions(topics.GROUPS), set())
    collector.context = 1 << 20  # the tiny model's 2048 positions would refuse 32K-token trajectories
    return collector


def take_all(collector: GroupCollector, count: int, batch: int) -> float:
    """Take ``count`` groups in batches; when the last batch was ready."""
    taken = 0
    while taken < count:
        taken += len(collector.take(min(batch, count - taken), version=0, stopping=lambda: False))
    return time.monotonic()


def pipeline_run(cfg: Config, make: Groups, processors: int, workdir: Path) -> dict[str, float]:
    """Burst throughput with ``processors`` processes; with one, also the paced latency."""
    size = make.size
    warmup, burst = make.many("warmup", 2 * PARTITIONS), make.many("burst", size.groups)
    paced = make.many("paced", size.paced) if processors == 1 else []
    admit(cfg, warmup + burst + paced)
    procs = [start_processor(cfg, workdir) for _ in range(processors)]
    producer, collector = RecordProducer(cfg.broker, client_id="bench"), trainer(cfg)
    try:
        wait_members(cfg, processors)
        publish(producer, warmup)
        take_all(collector, len(warmup), size.batch)
        started, wall_started = time.monotonic(), time.time()
        publisher = threading.Thread(target=publish, args=(producer, burst))
        publisher.start()
        ready = take_all(collector, len(burst), size.batch)
        publisher.join()
        emitted = last_emitted(cfg, {group_id for group_id, _ in burst}) - wall_started
        latencies = []
        for group in paced:
            publish(producer, [group])
            sent = time.monotonic()
            latencies.append((take_all(collector, 1, 1) - sent) * 1000)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        collector.close()
    return {"seconds": ready - started, "emitted_seconds": emitted, "mb": megabytes(burst),
            "trajectories": size.groups * size.group_size, "latencies": latencies}


def last_emitted(cfg: Config, group_ids: set[str]) -> float:
    """When the last of the groups' manifests was emitted: the broker's timestamp (the processor's CreateTime)."""
    reader = RecordConsumer(cfg.broker, topics.GROUPS, f"bench-emitted-{time.time()}").assign(
        partitions=range(PARTITIONS))
    try:
        return max(d.ts for d in reader.drain(idle_s=1.0) if d.records[0].group_id in group_ids)
    finally:
        reader.close()


def forward(cfg: Config, stopping: threading.Event) -> None:
    """Every source value sent on to COPY as it is, by the processor's clients and batch size."""
    consumer = SourceConsumer(cfg.broker, SOURCES, f"{cfg.broker.topic_prefix}bench-forward")
    producer = RecordProducer(cfg.broker, client_id="bench-forward")
    while not stopping.is_set():
        for message in consumer.consume(BATCH, 0.05):
            producer.send_raw(COPY, message.value, message.key, message.headers)
        producer.poll()
    producer.flush()
    consumer.close()


@contextlib.contextmanager
def thread_forwarder(cfg: Config) -> Iterator[None]:
    """``forward`` in a thread of this process while the block runs."""
    stopping = threading.Event()
    forwarder = threading.Thread(target=forward, args=(cfg, stopping))
    forwarder.start()
    try:
        yield
    finally:
        stopping.set()
        forwarder.join()


@contextlib.contextmanager
def faust_forwarder(cfg: Config, workdir: Path) -> Iterator[None]:
    """benchmarks/faust_forward.py's app, in its own process, forwarding SOURCES to COPY while the block runs."""
    app = faust_forward.start(cfg, topic_name(cfg.broker, COPY), [topic_name(cfg.broker, s) for s in SOURCES], workdir)
    try:
        yield
    finally:
        app.terminate()
        app.wait(30)


def copy_run(cfg: Config, groups: list[Group], forwarder: ContextManager[None] | None = None) -> float:
    """Seconds from the first publish to the last copy read back, a forwarder in between (by default
    ``thread_forwarder``)."""
    total = sum(len(values) for _, values in groups)
    consumer = RawConsumer(cfg.broker, f"bench-copy-{time.time()}").assign(
        {(topic_name(cfg.broker, COPY), p): None for p in range(PARTITIONS)})
    try:
        with forwarder or thread_forwarder(cfg):
            publish(RecordProducer(cfg.broker, client_id="bench-copy"), groups[:1])  # it has joined and reads
            read_copies(consumer, len(groups[0][1]))
            started = time.monotonic()
            publish(RecordProducer(cfg.broker, client_id="bench-copy"), groups[1:])
            read_copies(consumer, total - len(groups[0][1]))
            return time.monotonic() - started
    finally:
        consumer.close()


def read_copies(consumer: RawConsumer, count: int, timeout_s: float = 600.0) -> None:
    deadline, got = time.monotonic() + timeout_s, 0  # a hang guard: a forwarder that died forwards nothing
    while got < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{got} of {count} copies after {timeout_s}s")
        got += len(consumer.consume(timeout=1.0, limit=BATCH))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def measure(name: str, size: Size) -> dict:
    make = Groups(size)
    with services(Config()) as live, tempfile.TemporaryDirectory() as workdir:
        runs = {n: pipeline_run(namespace(live, f"{name}-p{n}", size), make, n, Path(workdir)) for n in size.scaling}
        groups = make.many("raw", size.groups)
        raw = {mode: megabytes(groups) / raw_run(namespace(live, f"{name}-raw-{mode}", size), make.make("warmup#0"),
                                                 groups, mode == "concurrent")
               for mode in ("sequential", "concurrent")}
        copy_cfg = namespace(live, f"{name}-copy", size)
        copy_s = copy_run(copy_cfg, make.many("copy", size.groups + 1))
        if name in FAUST_SIZES:
            faust_cfg = namespace(live, f"{name}-faust", size)
            faust_s = copy_run(faust_cfg, make.many("faust", size.groups + 1),
                               faust_forwarder(faust_cfg, Path(workdir)))
    one = runs[1]
    pipeline_mb_s, raw_mb_s = one["mb"] / one["seconds"], max(raw.values())
    return {
        "size": name, "group_size": size.group_size, "tokens": size.prompt + size.response, "r3": size.r3,
        "groups": size.groups, "batch": size.batch, "payload_mb": round(one["mb"], 1),
        "traj_s": round(one["trajectories"] / one["seconds"], 1), "pipeline_mb_s": round(pipeline_mb_s, 1),
        "raw_mb_s": round(raw_mb_s, 1), "raw_sequential_mb_s": round(raw["sequential"], 1),
        "raw_concurrent_mb_s": round(raw["concurrent"], 1), "ratio": round(pipeline_mb_s / raw_mb_s, 3),
        "p50_ms": round(percentile(one["latencies"], 0.5), 1), "p99_ms": round(percentile(one["latencies"], 0.99), 1),
        "paced_groups": size.paced,
        "processor_traj_s": round(one["trajectories"] / one["emitted_seconds"], 1),
        "scaling_traj_s": {n: round(run["trajectories"] / run["seconds"], 1) for n, run in runs.items()},
        "scaling_processor_traj_s": {n: round(run["trajectories"] / run["emitted_seconds"], 1) for n, run in runs.items()},
        "copy_ratio": round(one["mb"] / copy_s / raw_mb_s, 3),
        **({"faust_forward_traj_s": round(one["trajectories"] / faust_s, 1),
            "faust_forward_ratio": round(one["mb"] / faust_s / raw_mb_s, 3)} if name in FAUST_SIZES else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every size's group counts")
    args = parser.parse_args()
    results = []
    for name in args.sizes.split(","):
        size = SIZES[name]
        size = dataclasses.replace(size, groups=max(1, round(size.groups * args.scale)),
                                   paced=max(1, round(size.paced * args.scale)))
        results.append(measure(name, size))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"sizes": results}))


if __name__ == "__main__":
    main()
