"""``milestream run``: the whole loop on one machine, every stage its own process.

    start broker and Redis (or use the given ones), create the topics, fill the credit
    publish prompts; start the processor, the rollout workers and the trainer
    follow buffer.metrics and buffer.dropped, print each trainer step
    when the trainer finishes: stop everything, write summary.json and the plot
    (an archiver, started first and stopped last, keeps every topic on disk; a run started again
    on the same run folder resumes from that archive)
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

from milestream.config import Config
from milestream.consumers.report import write_report
from milestream.infra.kafka import Admin, RecordConsumer
from milestream.infra.services import die_with_parent, free_port, services, terminate
from milestream.schemas import topics
from milestream.schemas.records import Dropped, Metrics
from milestream.streams.credit import Credit

log = logging.getLogger(__name__)


class Child:
    """A stage running as ``python -m milestream.cli COMMAND --config run_dir/config.yaml``."""

    def __init__(self, name: str, command: list[str], config_path: Path, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "milestream.cli", *command, "--config", str(config_path)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)

    def stop(self, grace: float = 20.0) -> None:
        terminate(self.proc, grace)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def prepare(cfg: Config) -> None:
    """Build the model cache once here, rather than in every stage at once."""
    import torch

    from milestream.infra.model import load_model, load_tokenizer

    load_tokenizer(cfg.model)
    load_model(cfg.model, dtype=torch.float32)


def start_stages(cfg: Config, config_path: Path, log_dir: Path) -> tuple[list[Child], Child]:
    prepare(cfg)
    Admin(cfg.broker).create_topics()
    Credit(cfg).initialise()
    children = [Child("archiver", ["archive"], config_path, log_dir)] if cfg.run.archive else []
    children += [Child("loader", ["load-prompts", "--follow"], config_path, log_dir),
                Child("processor", ["process"], config_path, log_dir)]
    children += [Child(f"rollout-{i}", ["rollout", "--worker-id", f"worker-{i}"], config_path, log_dir)
                 for i in range(cfg.rollout.num_workers)]
    if cfg.run.prometheus_port is not None:
        port = cfg.run.prometheus_port or free_port()
        children.append(Child("metrics", ["metrics", "--prometheus-port", str(port)], config_path, log_dir))
        print(f"Prometheus metrics: http://127.0.0.1:{port}/metrics", flush=True)
    trainer = Child("trainer", ["train"], config_path, log_dir)
    return children + [trainer], trainer


def follow(cfg: Config, children: list[Child], trainer: Child, started: float) -> tuple[list[Metrics], list[Dropped], str]:
    """Print trainer steps as they land; returns what the topics said once the trainer is done, and why it ended."""
    metrics = RecordConsumer(cfg.broker, topics.METRICS, "run-monitor").assign(partitions=[0])
    drops = RecordConsumer(cfg.broker, topics.DROPPED, "run-monitor").assign(partitions=range(cfg.broker.partitions))
    steps: list[Metrics] = []
    dropped: list[Dropped] = []
    stopped_by = "steps"

    def take(deliveries) -> None:
        for record in (r for d in deliveries for r in d.records):
            if record.source == "trainer":
                steps.append(record)
                print_step(cfg, record, dropped, time.monotonic() - started)

    while trainer.proc.poll() is None:
        dropped += [r for d in drops.drain(0.05, 1.0) for r in d.records]
        delivery = metrics.poll(0.5)
        take([delivery] if delivery else [])
        for child in children:
            if child.proc.poll() is not None and child is not trainer:
                raise RuntimeError(f"stage {child.name} exited with {child.proc.returncode}:\n{child.tail()}")
        if stopped_by == "steps" and time.monotonic() - started > cfg.run.max_wall_s:
            print(f"run.max_wall_s ({cfg.run.max_wall_s:.0f}s) reached: the trainer finishes its step and stops", flush=True)
            trainer.proc.terminate()
            stopped_by = "wall_budget"
    if trainer.proc.returncode != 0:
        raise RuntimeError(f"the trainer exited with {trainer.proc.returncode}:\n{trainer.tail()}")
    dropped += [r for d in drops.drain(0.5, 10.0) for r in d.records]  # it flushed everything before exiting
    take(metrics.drain(0.5, 10.0))
    metrics.close()
    drops.close()
    return steps, dropped, stopped_by


def print_step(cfg: Config, record: Metrics, dropped: list[Dropped], elapsed: float) -> None:
    v = record.values
    reasons: dict[str, int] = {}
    for d in dropped:
        reasons[d.reason] = reasons.get(d.reason, 0) + 1
    print(f"step {record.step:3d}/{cfg.trainer.steps}  reward {v['reward_mean']:.3f}  "
          f"staleness {v['staleness_mean']:.2f} (max {v['staleness_max']:.0f})  queue {v['queue_size']:.0f}  "
          f"dropped {reasons or '-'}  loss {v['loss']:+.4f}  step {v['step_s']:.1f}s  [{elapsed:.0f}s]", flush=True)


def resume_from_archive(cfg: Config, run_dir: Path) -> None:
    """A fresh embedded broker holds nothing: put the archived run back, at the same offsets."""
    from milestream.consumers.replay import resume

    report, accounting = resume(cfg, run_dir)
    print(f"resumed from the archive in {run_dir / 'archive'}: {report} {accounting}", flush=True)


def run_loop(cfg: Config) -> dict:
    started = time.monotonic()
    run_dir = cfg.run_path
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    with services(cfg) as live:
        config_path = run_dir / "config.yaml"
        config_path.write_text(live.to_yaml())
        if cfg.run.archive and not cfg.broker.bootstrap_servers and (run_dir / "archive" / "manifest.json").exists():
            resume_from_archive(live, run_dir)
        children, trainer = start_stages(live, config_path, log_dir)
        try:
            steps, dropped, stopped_by = follow(live, children, trainer, started)
        finally:
            for child in reversed(children):
                child.stop(grace=120.0 if child is trainer else 20.0)
        summary = write_report(run_dir, steps, dropped, time.monotonic() - started, stopped_by=stopped_by)
    print(f"summary: {summary}")
    print(f"wrote {run_dir / 'summary.json'} and {run_dir / 'reward_staleness.png'}")
    return summary
