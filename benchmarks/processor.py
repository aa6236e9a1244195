"""Stream-processor throughput and latency, against a plain forward of the same records by the same client.

Prints one JSON line:
  processor_groups_s   groups/s through the processor: a burst of groups published onto
                       rollout.trajectories + rollout.logprobs, from the first publish to the last
                       group's emission on buffer.groups
  forward_groups_s     the same records, the same burst, through a minimal forwarder on the processor's
                       own clients (a consumer-group member taking batches, the same producer) that sends
                       the raw values of both source topics on to one topic: groups/s to the forwarding
                       of the last record
  ratio                processor_groups_s / forward_groups_s
  faust_forward_groups_s  the same burst through the cheapest faust-streaming processor
                       (benchmarks/faust_forward.py: an agent on both source topics, raw key and value,
                       ``stream.take_events(BATCH, within=0.05)``, each value sent on with its key and
                       headers by faust's own producer, no logic): groups/s to the forwarding of the last
                       record; faust_forward_p50_ms / faust_forward_p99_ms: its paced latency, as forward's
  faust_vs_processor   faust_forward_groups_s / processor_groups_s: above 1, faust doing nothing outruns
                       the processor doing everything
  p50_ms / p99_ms      the last record of a group published -> its group emitted on buffer.groups, at
                       a paced rate (no backlog queueing); forward_p50_ms / forward_p99_ms: the same
                       to the forwarding of the group's last record

"Emitted" is the CreateTime the app's producer stamps on its output record (1 ms resolution), so
the figures do not depend on how fast this script reads the output back. The three apps run one after
the other as separate processes on one broker (topic prefixes bench-processor., bench-forward. and
bench-faust.).

    .venv/bin/python benchmarks/processor.py [--groups 300] [--group-size 8] [--response-tokens 512]
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import data_plane  # benchmarks/ is a folder of scripts: this one's own folder is on the path
import faust_forward

from milestream.config import Config, load_config
from milestream.infra.kafka import Admin, RecordConsumer, RecordProducer, SourceConsumer, topic_name
from milestream.infra.secret_env import stage_environment
from milestream.infra.services import die_with_parent, services
from milestream.schemas import topics
from milestream.schemas.records import Trajectory
from milestream.streams.ledger import BufferLedger

FORWARDED = topics.TopicSpec("bench.forwarded", Trajectory, "group id")
SOURCES = (topics.TRAJECTORIES, topics.LOGPROBS)


def serve_forward(cfg: Config) -> None:
    """The baseline: every source value forwarded as it is, on the processor's clients and batch size."""
    from milestream.streams.processor import BATCH

    consumer = SourceConsumer(cfg.broker, SOURCES, f"{cfg.broker.topic_prefix}bench-forward")
    producer = RecordProducer(cfg.broker, client_id="bench-forward")
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    while not stopping:
        for message in consumer.consume(BATCH, 0.05):
            producer.send_raw(FORWARDED, message.value, message.key, message.headers)
        producer.poll()
    producer.flush()
    consumer.close()


def start_forward(cfg: Config, workdir: Path) -> subprocess.Popen:
    config_path = workdir / "forward.yaml"
    config_path.write_text(cfg.to_yaml())  # without the Redis password: the app gets it in its environment
    return subprocess.Popen([sys.executable, __file__, "--serve-forward", str(config_path)], env=stage_environment(cfg),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)


def start_faust(cfg: Config, workdir: Path) -> subprocess.Popen:
    return faust_forward.start(cfg, topic_name(cfg.broker, FORWARDED),
                               [topic_name(cfg.broker, spec) for spec in SOURCES], workdir)


class OutputReader:
    """Reads an output topic's raw messages from the beginning; no decoding, so reading costs little."""

    def __init__(self, cfg: Config, spec: topics.TopicSpec):
        reader = RecordConsumer(cfg.broker, spec, f"bench-reader-{time.time()}")
        self.consumer = reader.assign(partitions=range(cfg.broker.partitions)).consumer  # its raw messages

    def emitted(self, messages_per_group: dict[str, int], timeout_s: float = 300.0) -> dict[str, float]:
        """When each group was emitted: the latest CreateTime (s) of its expected output messages."""
        remaining, emitted = dict(messages_per_group), {}
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(remaining)} groups never came out, e.g. {sorted(remaining)[:3]}")
            message = self.consumer.poll(0.5)
            if message is None or message.error():
                continue
            gid = message.key().decode()
            if gid in remaining:
                emitted[gid] = max(emitted.get(gid, 0.0), message.timestamp()[1] / 1000.0)
                remaining[gid] -= 1
                if remaining[gid] == 0:
                    del remaining[gid]
        return emitted

    def close(self) -> None:
        self.consumer.close()


def measure(cfg: Config, start_app: Callable[[], subprocess.Popen], output: topics.TopicSpec,
            messages_per_group: int, warmup, burst, paced, rate_per_s: float) -> tuple[float, list[float]]:
    """(groups/s over the burst, paced latencies in ms) of one app, started here and stopped after."""
    producer = RecordProducer(cfg.broker, client_id="bench")
    reader = OutputReader(cfg, output)
    app = start_app()
    try:
        data_plane.publish(producer, [warmup])
        reader.emitted({warmup[0]: messages_per_group})  # the app has joined its group and is reading
        started = time.time()
        data_plane.publish(producer, burst)
        emitted = reader.emitted({gid: messages_per_group for gid, _ in burst})
        groups_s = len(burst) / (max(emitted.values()) - started)
        latencies = []
        for gid, records in paced:
            began = time.monotonic()
            data_plane.publish(producer, [(gid, records[:-1])])
            last_published = time.time()  # just before the group's last record is produced
            data_plane.publish(producer, [(gid, records[-1:])])
            latencies.append((reader.emitted({gid: messages_per_group})[gid] - last_published) * 1000)
            time.sleep(max(0.0, 1 / rate_per_s - (time.monotonic() - began)))
        return groups_s, latencies
    finally:
        app.terminate()
        app.wait(30)
        reader.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--latency-groups", type=int, default=100)
    parser.add_argument("--rate", type=float, default=20.0, help="paced groups per second for the latency")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--serve-forward", metavar="CONFIG", help=argparse.SUPPRESS)  # the baseline app
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.serve_forward:
        serve_forward(load_config(args.serve_forward))
        return
    groups = data_plane.Groups(data_plane.Size(args.group_size, args.prompt_tokens, args.response_tokens, False,
                                               args.groups, args.latency_groups, 1))
    warmup, burst = groups.make("warmup#0"), groups.many("burst", args.groups)
    paced = groups.many("paced", args.latency_groups)
    per_group = 2 * args.group_size  # source records of one group: its trajectories and log-probs
    with services(Config()) as live, tempfile.TemporaryDirectory() as workdir:
        processor_cfg = live.with_overrides(buffer={"capacity_factor": 1e6}, rollout={"group_size": args.group_size},
                                            broker={"topic_prefix": "bench-processor."})
        forward_cfg = live.with_overrides(broker={"topic_prefix": "bench-forward."})
        faust_cfg = live.with_overrides(broker={"topic_prefix": "bench-faust."})
        for cfg in (processor_cfg, forward_cfg, faust_cfg):
            Admin(cfg.broker).create_topics([*topics.CATALOGUE, FORWARDED])
        BufferLedger(processor_cfg).initialise()
        data_plane.admit(processor_cfg, [warmup, *burst, *paced])
        processor_s, latencies = measure(processor_cfg, lambda: data_plane.start_processor(processor_cfg, Path(workdir)),
                                         topics.GROUPS, 1, warmup, burst, paced, args.rate)
        forward_s, forward_latencies = measure(forward_cfg, lambda: start_forward(forward_cfg, Path(workdir)),
                                               FORWARDED, per_group, warmup, burst, paced, args.rate)
        faust_s, faust_latencies = measure(faust_cfg, lambda: start_faust(faust_cfg, Path(workdir)),
                                           FORWARDED, per_group, warmup, burst, paced, args.rate)
    pct = lambda values, q: round(data_plane.percentile(values, q), 1)  # noqa: E731
    print(json.dumps({
        "groups": args.groups, "group_size": args.group_size, "response_tokens": args.response_tokens,
        "processor_groups_s": round(processor_s, 1), "forward_groups_s": round(forward_s, 1),
        "ratio": round(processor_s / forward_s, 4),
        "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99),
        "forward_p50_ms": pct(forward_latencies, 0.5), "forward_p99_ms": pct(forward_latencies, 0.99),
        "faust_forward_groups_s": round(faust_s, 1), "faust_vs_processor": round(faust_s / processor_s, 4),
        "faust_forward_p50_ms": pct(faust_latencies, 0.5), "faust_forward_p99_ms": pct(faust_latencies, 0.99),
        "latency_groups": args.latency_groups, "rate_per_s": args.rate,
    }))


if __name__ == "__main__":
    main()
