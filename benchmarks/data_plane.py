"""Data-plane throughput and latency: rollout records -> stream processor -> trainer-ready groups.

Prints one JSON line:
  pipeline_traj_s / pipeline_mb_s  trajectories and MB/s from the first publish to the last group
                                   read back from buffer.groups (processor in between, burst load)
  raw_mb_s                         the same encoded bytes produced to a plain topic and consumed back
                                   in the same run (the broker's own ceiling on this machine)
  ratio                            pipeline_mb_s / raw_mb_s
  p50_ms / p99_ms                  publish of a group's last record -> its group readable on
                                   buffer.groups, at a paced rate (no backlog queueing)

    python benchmarks/data_plane.py [--groups 300] [--group-size 8] [--response-tokens 512]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milestream.config import Config
from milestream.infra.kafka import Admin, RecordConsumer, RecordProducer
from milestream.infra.secret_env import stage_environment
from milestream.infra.services import die_with_parent, services
from milestream.schemas import topics
from milestream.schemas.codec import encode, headers_for
from milestream.schemas.records import LogProbs, Trajectory
from milestream.streams.ledger import BufferLedger

RAW = topics.TopicSpec("bench.raw", Trajectory, "group id")


def make_group(index: int, group_size: int, prompt_tokens: int, response_tokens: int, rng: random.Random):
    gid = f"bench-{index}#0"
    records = []
    for i in range(group_size):
        n = rng.randint(response_tokens // 2, response_tokens)
        trajectory = Trajectory(
            f"{gid}/{i}", gid, f"bench-{index}", i, group_size, [rng.randrange(49152) for _ in range(prompt_tokens)],
            [rng.randrange(49152) for _ in range(n)], [1] * n, [0] * n, rng.random(), "completed", "x" * n,
            "bench", "bench", 0.0, 0.0)
        logprobs = LogProbs(f"{gid}/{i}", gid, i, group_size, [-rng.random() for _ in range(n)])
        records.append((topics.TRAJECTORIES, encode([trajectory]), Trajectory))
        records.append((topics.LOGPROBS, encode([logprobs]), LogProbs))
    return gid, records


def admit(cfg: Config, groups) -> None:
    """Admit the groups as a rollout worker would: the processor takes records of admitted groups only."""
    ledger = BufferLedger(cfg)
    for gid, _ in groups:
        ledger.admit(gid, "bench", 0)


def publish(producer: RecordProducer, gid: str, records) -> None:
    for spec, value, cls in records:
        producer.send_raw(spec, value, gid, headers_for(cls))


def start_processor(cfg: Config, workdir: Path) -> subprocess.Popen:
    config_path = workdir / "config.yaml"
    config_path.write_text(cfg.to_yaml())  # without the Redis password: the stage gets it in its environment
    return subprocess.Popen([sys.executable, "-m", "milestream.cli", "process", "--config", str(config_path),
                             "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=stage_environment(cfg), preexec_fn=die_with_parent)


def wait_for_groups(consumer: RecordConsumer, wanted: set[str], timeout: float = 300.0) -> dict[str, float]:
    """Receive times of the wanted group ids from buffer.groups."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while wanted - seen.keys() and time.monotonic() < deadline:
        delivery = consumer.poll(0.5)
        if delivery is not None and delivery.records[0].group_id in wanted:
            seen[delivery.records[0].group_id] = time.monotonic()
    if wanted - seen.keys():
        raise TimeoutError(f"{len(wanted - seen.keys())} groups never reached buffer.groups")
    return seen


def pipeline_run(cfg: Config, groups, producer: RecordProducer, consumer: RecordConsumer) -> float:
    started = time.monotonic()
    for gid, records in groups:
        publish(producer, gid, records)
    producer.flush()
    wait_for_groups(consumer, {gid for gid, _ in groups})
    return time.monotonic() - started


def latency_run(groups, producer: RecordProducer, consumer: RecordConsumer, rate_per_s: float) -> list[float]:
    latencies = []
    for gid, records in groups:
        publish(producer, gid, records)
        producer.flush()
        sent = time.monotonic()
        latencies.append((wait_for_groups(consumer, {gid})[gid] - sent) * 1000)
        time.sleep(max(0.0, 1 / rate_per_s - (time.monotonic() - sent)))
    return latencies


def raw_run(cfg: Config, groups) -> float:
    producer = RecordProducer(cfg.broker, client_id="bench-raw")
    consumer = RecordConsumer(cfg.broker, RAW, "bench-raw").assign(partitions=range(cfg.broker.partitions))
    total = sum(len(records) for _, records in groups)
    started = time.monotonic()
    for gid, records in groups:
        for _, value, cls in records:
            producer.send_raw(RAW, value, gid, headers_for(cls))
    producer.flush()
    received = 0
    while received < total:
        message = consumer.consumer.poll(1.0)
        if message is not None and not message.error():
            received += 1
    elapsed = time.monotonic() - started
    consumer.close()
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--latency-groups", type=int, default=100)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=512)
    args = parser.parse_args()
    rng = random.Random(0)
    make = lambda i: make_group(i, args.group_size, args.prompt_tokens, args.response_tokens, rng)  # noqa: E731
    warmup, burst = [make(-1)], [make(i) for i in range(args.groups)]
    paced = [make(args.groups + i) for i in range(args.latency_groups)]
    payload_bytes = sum(len(v) for _, records in burst for _, v, _ in records)
    with services(Config()) as live, tempfile.TemporaryDirectory() as workdir:
        cfg = live.with_overrides(buffer={"capacity_factor": 1e6}, broker={"topic_prefix": "bench."},
                                  rollout={"group_size": args.group_size})
        Admin(cfg.broker).create_topics([*topics.CATALOGUE, RAW])
        BufferLedger(cfg).initialise()
        admit(cfg, warmup + burst + paced)
        processor = start_processor(cfg, Path(workdir))
        producer = RecordProducer(cfg.broker, client_id="bench")
        consumer = RecordConsumer(cfg.broker, topics.GROUPS, "bench-trainer").assign(partitions=range(cfg.broker.partitions))
        try:
            pipeline_run(cfg, warmup, producer, consumer)  # processor joined its group and is reading
            pipeline_s = pipeline_run(cfg, burst, producer, consumer)
            latencies = latency_run(paced, producer, consumer, rate_per_s=20.0)
        finally:
            processor.terminate()
            processor.wait(30)
        raw_s = raw_run(cfg, burst)
    mb = payload_bytes / 1e6
    trajectories = args.groups * args.group_size
    print(json.dumps({
        "groups": args.groups, "group_size": args.group_size, "payload_mb": round(mb, 2),
        "pipeline_traj_s": round(trajectories / pipeline_s, 1), "pipeline_mb_s": round(mb / pipeline_s, 2),
        "raw_mb_s": round(mb / raw_s, 2), "ratio": round(raw_s / pipeline_s, 4),
        "p50_ms": round(percentile(latencies, 0.5), 1), "p99_ms": round(percentile(latencies, 0.99), 1),
    }))


if __name__ == "__main__":
    main()
