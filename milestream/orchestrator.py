"""``milestream run``: the whole loop on one machine, every stage its own process.

    start broker and Redis (or use the given ones), create the topics, fill the credit
    publish prompts; start the processor, the rollout workers (and with distill the teacher) and the trainer
    follow buffer.metrics, buffer.dropped and eval.results, print each trainer step and each evaluation
    (dead-lettering a record none of the stages wrote: log/lineage.py check_observed)
    when the trainer finishes: stop everything, evaluate the version it ended on unless an evaluator
    did (evaluate/evaluation.py ``finish_evaluation``), write summary.json and the plot
    (an archiver, started first and stopped last, keeps every topic on disk; a run started again
    on the same run folder resumes from that archive, and is refused before anything starts when its
    configuration differs from the folder's config.yaml beyond RESUME_MAY_CHANGE (below); the
    embedded Redis's password is in RUN_DIR/credentials.json (mode 0600) while the run lasts, for a
    worker started by hand to join it; the metrics stage serves the live page, and the
    tracker stage, when observe.* switches a writer on, fills TensorBoard, W&B or MLflow: it too stays
    for the last evaluation)

Supervision: a stage that dies (a crash, an OOM kill, a SIGKILL) is started again, up to
``run.max_restarts`` times each; the log is what makes that safe (the processor rebuilds its partial
groups, the trainer resumes from its checkpoint, rollout re-reads uncommitted prompts). A rollout worker
that stops itself because failures persist (exit code 3) stops the run, with its last error. If an
embedded service dies, every stage stops and a new one comes up on the same port: a new broker gets the
archive republished into it; a new Redis gets the buffer ledger rebuilt from the log (the live broker's
topics, or the archive when the broker was lost too; log/accounting.py); then the stages start again.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import yaml

from milestream.config import Config, UserError, knob_values
from milestream.engines.vllm import check_vllm
from milestream.evaluate.evaluation import finish_evaluation
from milestream.infra.kafka import Admin, RecordProducer
from milestream.infra.secret_env import run_credentials, stage_environment
from milestream.infra.services import Services, die_with_parent, embedded, free_port, terminate, wait_or_kill
from milestream.log.accounting import rebuild_from_broker
from milestream.log.lineage import Lineage, check_observed
from milestream.observe.feed import TopicFeed
from milestream.observe.track import check_writers
from milestream.producers.worker import EXIT_GAVE_UP
from milestream.observe.report import write_report
from milestream.producers.inputs import check_inputs
from milestream.producers.teacher import check_teacher
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import EvalResult, Metrics, Record
from milestream.streams.ledger import BufferLedger

log = logging.getLogger(__name__)


# How long a stage may take to stop. After a lost service it may not wait on it: a flush or a commit to a
# broker that is gone only times out (30 s), and every stage's state is safe from SIGKILL at any point
# (docs/exactly-once.md). The archiver writes to local disk, so it keeps its grace and saves what it read.
STOP_GRACE_S = 20.0
TRAINER_STOP_GRACE_S = 120.0  # time to finish its step
SERVICE_LOST_GRACE_S = 2.0
# After a lost service every stage starts again at once. On two cores the stages off the path to the next step
# (the page, the trackers, the verifier, a dedicated evaluator: each imports torch, the evaluator loads the model)
# would take CPU from the trainer's and the rollout workers' starts, so they wait for the first trainer step
# after the recovery, or SIDE_STAGE_WAIT_S at most. What they read waits for them on the log.
SIDE_STAGES = ("metrics", "tracker", "verifier", "evaluator")
SIDE_STAGE_WAIT_S = 60.0


class Child:
    """A stage running as ``python -m milestream.cli COMMAND --config run_dir/config.yaml``, with the
    configuration's secrets (which that file never holds) in its environment ``env``."""

    def __init__(self, name: str, command: list[str], config_path: Path, log_dir: Path, env: dict[str, str],
                 deferred: bool = False):
        self.name = name
        self.argv = [sys.executable, "-m", "milestream.cli", *command, "--config", str(config_path)]
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.lives = 0
        self.proc: subprocess.Popen | None = None  # None: deferred, not started yet
        if not deferred:
            self.start()

    def start(self) -> None:
        """Start (again): every life appends to the stage's one log."""
        self.lives += 1
        with open(self.log_path, "a") as out:
            out.write(f"==== life {self.lives} {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            out.flush()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, preexec_fn=die_with_parent)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        terminate(self.proc, grace)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def prepare(cfg: Config) -> None:
    """Build the model cache once here, rather than in every stage at once."""
    import torch

    from milestream.infra.model import load_model, load_tokenizer
    from milestream.train.backends.base import check_backend

    load_tokenizer(cfg.model)
    load_model(cfg.model, dtype=torch.float32)
    check_backend(cfg)


def page_port(cfg: Config) -> int:
    """run.prometheus_port, or (0) the port this run folder's page had before when it is free, so an open page
    finds the run again after ``milestream run`` is started again on the folder; RUN_DIR/page.url says where."""
    saved = cfg.run_path / "page.url"
    port = cfg.run.prometheus_port
    if not port and saved.exists():
        before = int(saved.read_text().strip().rsplit(":", 1)[1].rstrip("/"))
        with socket.socket() as sock:
            port = before if sock.connect_ex(("127.0.0.1", before)) != 0 else 0
    port = port or free_port()
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(f"http://127.0.0.1:{port}/\n")
    return port


def rollout_stages(cfg: Config, index: int) -> list[tuple[str, list[str]]]:
    """Rollout worker ``index``; under rollout.engine vllm without rollout.engine_url, first the vLLM server it
    generates on, a stage of its own (``vllm-N``) on a port chosen here, which a restart keeps."""
    worker = ["rollout", "--worker-id", f"worker-{index}"]
    if cfg.rollout.engine != "vllm" or cfg.rollout.engine_url:
        return [(f"rollout-{index}", worker)]
    port = free_port()
    return [(f"vllm-{index}", ["serve-vllm", "--port", str(port)]),
            (f"rollout-{index}", [*worker, "--set", f"rollout.engine_url=http://127.0.0.1:{port}"])]


def start_stages(cfg: Config, config_path: Path, log_dir: Path, recovering: bool = False) -> tuple[list[Child], Child]:
    """Every stage of the run; ``recovering`` (after a lost service): the model cache is built already, and the
    SIDE_STAGES are made deferred (started by ``follow``)."""
    if not recovering:
        prepare(cfg)
    Admin(cfg.broker).create_topics()
    ledger = BufferLedger(cfg)
    ledger.initialise()
    ledger.raise_trainer_version(0)  # from the start, an announcement past the trainer's version is refused
    env = stage_environment(cfg)

    def child(name: str, command: list[str]) -> Child:
        return Child(name, command, config_path, log_dir, env, deferred=recovering and name in SIDE_STAGES)

    children = [child("archiver", ["archive"])] if cfg.run.archive else []
    children += [child("loader", ["load-prompts", "--follow"]), child("processor", ["process"])]
    children += [child(name, command) for i in range(cfg.rollout.num_workers)
                 for name, command in rollout_stages(cfg, i)]
    if cfg.distill.enabled:  # on-policy distillation: the teacher scores every trajectory
        children.append(child("teacher", ["teacher"]))
    if cfg.run.prometheus_port is not None:
        port = page_port(cfg)
        children.append(child("metrics", ["metrics", "--serve", "--prometheus-port", str(port),
                                          "--jsonl", str(cfg.run_path / "metrics.jsonl")]))
        print(f"live page: http://127.0.0.1:{port}/  (Prometheus: http://127.0.0.1:{port}/metrics)", flush=True)
    if cfg.observe.writers:
        children.append(child("tracker", ["track"]))
    children.append(child("verifier", ["verify-weights"]))
    if cfg.eval.mode in ("dedicated", "external"):  # eval.mode shared runs inside the rollout workers
        children.append(child("evaluator", ["eval"]))
    trainer = child("trainer", ["train"])
    return children + [trainer], trainer


class ServiceLost(RuntimeError):
    """An embedded service (the broker, Redis) died under the run."""


class Monitor:
    """What the topics say about the run: its lineage of trainer steps and drops (log/lineage.py), and
    its evaluations. ``printed``: the steps and the evaluations already printed (by an earlier monitor too)."""

    def __init__(self, cfg: Config, printed: set[int], printed_evals: set[tuple[str, int, float]], started: float):
        self.cfg, self.printed, self.printed_evals, self.started = cfg, printed, printed_evals, started
        self.lineage = Lineage()
        self.ledger = BufferLedger(cfg)
        # the stage that reads these topics in every run: it dead-letters what none of the run's stages wrote
        self.producer = RecordProducer(cfg.broker, client_id="run-monitor")
        self.feed = TopicFeed(cfg, "run-monitor", specs=(topics.METRICS, topics.DROPPED, topics.EVAL_RESULTS),
                              deadletter=self.producer, check=self._check)

    def _check(self, records: list[Record], position: Position) -> None:
        def sent(group_id: str) -> bool:
            return self.ledger.settlement(group_id) is not None

        for record in records:
            check_observed(record, position, self.cfg.trainer.steps, self.cfg.trainer.batch_groups, sent,
                           self.cfg.eval.mode is not None)

    def poll(self, drain: bool = False) -> None:
        """Take what arrived (with ``drain``, everything up to the topics' ends now: no wait for a quiet spell,
        which stages that report every half second may never leave), printing each trainer step once."""
        items = self.feed.drain(0.0, 20.0) if drain else self.feed.poll(0.5)
        for item in items:
            self.lineage.observe(item.record, item.position)
        for record in (item.record for item in items if item.spec == topics.METRICS):
            if record.source == "trainer" and record.step not in self.printed:
                self.printed.add(record.step)
                print_step(self.cfg, self.lineage.steps[record.step], self.lineage,
                           time.monotonic() - self.started)
        print_evaluations([item.record for item in items if item.spec == topics.EVAL_RESULTS], self.printed_evals)

    def newest_step_ts(self) -> float:
        """When the trainer wrote the newest step record read so far (epoch seconds; 0 before any)."""
        return max((record.ts for record in self.lineage.steps.values()), default=0.0)

    def close(self) -> None:
        self.feed.close()
        self.producer.close()  # its client's threads stop: once the broker is gone they would log each reconnect


def check_services(live: Services) -> None:
    """ServiceLost when an embedded service died."""
    if lost := live.lost():
        raise ServiceLost(" and ".join(f"the embedded {s.name} exited with {s.proc.returncode}" for s in lost))


def supervise(cfg: Config, live: Services, children: list[Child], trainer: Child, stopping: bool = False) -> None:
    """Start again each stage that died (the trainer not once it is ``stopping``); raise when one died too
    often, or ServiceLost. A service is looked at first: the stages it took down with it are not restarts to
    count."""
    check_services(live)
    for child in children:
        if child.proc is None:
            continue
        code = child.proc.poll()
        if code is None or (child is trainer and (code == 0 or stopping)):
            continue
        if code == EXIT_GAVE_UP:
            raise RuntimeError(f"stage {child.name} stopped the run:\n{child.tail(8)}")
        if child.lives > cfg.run.max_restarts:
            raise RuntimeError(f"stage {child.name} exited with {code}, {child.lives} lives, more than "
                               f"run.max_restarts ({cfg.run.max_restarts}):\n{child.tail()}")
        print(f"stage {child.name} exited with {code}; starting it again (life {child.lives + 1})", flush=True)
        child.start()


def follow(cfg: Config, live: Services, children: list[Child], trainer: Child, monitor: Monitor) -> str:
    """Watch until the trainer finishes, restarting stages that die and starting the deferred ones; returns why
    the run ended."""
    stopped_by = "steps"
    since, deferred = time.time(), [child for child in children if child.proc is None]
    while (code := trainer.proc.poll()) != 0 and not (code is not None and stopped_by == "wall_budget"):
        try:
            monitor.poll()  # its check asks the ledger whether a dropped group was sent
        except Exception:
            check_services(live)  # Redis died under that question: recovered as any service loss
            raise
        if deferred and (monitor.newest_step_ts() > since or time.time() - since > SIDE_STAGE_WAIT_S):
            deferred = _started(deferred)
        # told to stop at the wall budget, a trainer that dies is not started again: the run is over
        supervise(cfg, live, children, trainer, stopping=stopped_by == "wall_budget")
        if stopped_by == "steps" and time.monotonic() - monitor.started > cfg.run.max_wall_s:
            print(f"run.max_wall_s ({cfg.run.max_wall_s:.0f}s) reached: the trainer finishes its step and stops", flush=True)
            trainer.proc.terminate()
            stopped_by = "wall_budget"
    _started(deferred)  # a tracker or the page has the run's last steps to write even so
    monitor.poll(drain=True)  # the trainer flushed everything before exiting
    return stopped_by


def _started(deferred: list[Child]) -> list[Child]:
    """Starts the deferred stages; none is left deferred."""
    for child in deferred:
        child.start()
    return []


def print_step(cfg: Config, record: Metrics, lineage: Lineage, elapsed: float) -> None:
    v = record.values
    reasons = lineage.drop_reasons()
    print(f"step {record.step:3d}/{cfg.trainer.steps}  reward {v['reward_mean']:.3f}  "
          f"staleness {v['staleness_mean']:.2f} (max {v['staleness_max']:.0f})  queue {v['queue_size']:.0f}  "
          f"dropped {reasons or '-'}  loss {v['loss']:+.4f}  step {v['step_s']:.1f}s  [{elapsed:.0f}s]", flush=True)


def print_evaluations(results: list[EvalResult], printed: set[tuple[str, int, float]]) -> None:
    """One line per evaluation result not printed yet: ``eval v10 (step 10, lag 2): heldout 0.420``."""
    for r in results:
        if (r.name, r.version, r.ts) in printed:
            continue
        printed.add((r.name, r.version, r.ts))
        outcome = f"{r.score:.3f}" if r.status == "ok" else f"skipped ({r.detail})"
        print(f"eval v{r.version} (step {r.step}, lag {r.lag_steps}): {r.name} {outcome}", flush=True)


def stop_stages(children: list[Child], trainer: Child, keep: tuple[str, ...] = (), service_lost: bool = False) -> None:
    """Every stage but those named in ``keep``: all told at once, so stopping takes the longest grace rather than
    their sum; the archiver last, keeping what the others wrote while they stopped."""
    def grace(child: Child) -> float:
        if service_lost and child.name != "archiver":
            return SERVICE_LOST_GRACE_S
        return TRAINER_STOP_GRACE_S if child is trainer else STOP_GRACE_S

    stopping = [child for child in children if child.name not in keep]
    for wave in ([c for c in stopping if c.name != "archiver"], [c for c in stopping if c.name == "archiver"]):
        started = [child for child in wave if child.proc is not None]
        for child in started:
            if child.proc.poll() is None:
                child.proc.terminate()
        told = time.monotonic()
        for child in started:
            wait_or_kill(child.proc, grace(child) - (time.monotonic() - told))


def evaluate_run_end(cfg: Config, printed_evals: set[tuple[str, int, float]]) -> list[EvalResult]:
    """Every evaluation result of the run, the version it ended on evaluated if no evaluator did."""
    if cfg.eval.mode is None:
        return []
    results, _ = finish_evaluation(cfg)
    print_evaluations(results, printed_evals)
    return results


def resume_from_archive(cfg: Config, run_dir: Path, fresh_ledger: bool) -> None:
    """A fresh embedded broker holds nothing: put the archived run back, at the same offsets
    (``fresh_ledger``: the Redis holds nothing of the run either)."""
    from milestream.log.restore import resume

    report, accounting = resume(cfg, run_dir, fresh_ledger=fresh_ledger)
    print(f"resumed from the archive in {run_dir / 'archive'}: {report} {accounting}", flush=True)


def recover(live: Services, run_dir: Path) -> None:
    """With every stage stopped: start again each embedded service that died, and put back what it held."""
    redis_lost = live.redis_lost()
    if redis_lost:
        live.restart_redis()
    if live.broker_lost():
        live.restart_broker()
        resume_from_archive(live.cfg, run_dir, fresh_ledger=redis_lost)
    elif redis_lost:
        accounting = rebuild_from_broker(live.cfg, run_dir)
        print(f"rebuilt the buffer ledger on a new Redis from the broker's topics: {accounting}", flush=True)


class RunFolderConflict(UserError, ValueError):
    """A run folder that holds another run than the one a command would start on it."""


# What may differ between a run folder's config.yaml and a `milestream run` started again on the folder, which
# resumes the run from the folder's archive and checkpoints: how long it goes on, where its services are, how
# many workers it has and how it is watched. Everything else (the model, data, reward, rollout, objective,
# schedule, buffer rules, topics, weight transport) is what the folder's log and checkpoints were made with.
# A section's name covers its every knob.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "trainer.steps", "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.keep_weight_versions",
    "run.run_dir", "run.max_wall_s", "run.max_restarts", "run.prometheus_port",
    "broker.bootstrap_servers", "broker.client", "broker.fetch_wait_ms",
    "redis.url", "redis.password", "redis.ssl_ca_certs", "redis.ssl_certfile", "redis.ssl_keyfile",
    "model.threads",
    "rollout.num_workers", "rollout.max_inflight_samples", "rollout.max_batch", "rollout.engine_url",
    "rollout.max_errors", "rollout.error_window_s", "rollout.stop_grace_s",
    "buffer.metrics_interval_s", "buffer.commit_interval_s",
    "weights.sender_host",
    "eval.every_versions", "eval.timeout_s", "eval.keep_exports",
    "distill.teacher_url", "distill.timeout_s", "distill.batch_samples",
    "observe", "router", "sessions", "vllm",
)


def resume_conflicts(saved: Mapping[str, Any], cfg: Config) -> dict[str, tuple[Any, Any]]:
    """The knobs outside RESUME_MAY_CHANGE whose value in ``saved`` (a run folder's config.yaml) differs from
    ``cfg``'s: name -> (saved, given). A knob only one of them knows (another milestream version) is no conflict."""
    before, now = knob_values(saved), knob_values(cfg.model_dump(mode="json"))
    may_change = {name for name in before.keys() & now.keys()
                  if name in RESUME_MAY_CHANGE or name.split(".")[0] in RESUME_MAY_CHANGE}
    return {name: (before[name], now[name]) for name in sorted(before.keys() & now.keys() - may_change)
            if before[name] != now[name]}


def _shown(value: Any, chars: int = 60) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()
    return text if len(text) <= chars else text[:chars - 3] + "..."


def check_run_folder(cfg: Config) -> None:
    """Raise RunFolderConflict when ``cfg.run.run_dir`` holds another run's config.yaml: starting on it would resume
    that run (its archive, its checkpoints) with this configuration."""
    saved_path = cfg.run_path / "config.yaml"
    if not saved_path.exists():
        return
    conflicts = resume_conflicts(yaml.safe_load(saved_path.read_text()) or {}, cfg)
    if not conflicts:
        return
    differences = "; ".join(f"{name}: {_shown(before)} there, {_shown(now)} here"
                            for name, (before, now) in conflicts.items())
    raise RunFolderConflict(
        f"{cfg.run.run_dir} holds another run, which a run started on it would resume: its config.yaml differs "
        f"in {differences}. Give another --run-dir for a new run (or remove {cfg.run.run_dir} to start over); "
        f"to resume it, change only what may change on resume: how long it runs, where its services are, its "
        f"workers and how it is watched (RESUME_MAY_CHANGE in milestream/orchestrator.py)")


def run_loop(cfg: Config) -> dict:
    check_run_folder(cfg)  # a folder of another run (another model, data, ...) is not resumed with this one
    check_inputs(cfg)  # bad data or a bad reward fails here, before any stage (or the broker) starts
    check_writers(cfg)
    check_teacher(cfg)
    if cfg.rollout.engine == "vllm":
        check_vllm(cfg)
    started = time.monotonic()
    run_dir = cfg.run_path
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    printed: set[int] = set()
    printed_evals: set[tuple[str, int, float]] = set()
    with embedded(cfg) as live, contextlib.ExitStack() as credentials:
        config_path = run_dir / "config.yaml"
        config_path.write_text(live.cfg.to_yaml())  # without secrets: the stages get them in their environment
        if live.redis is not None:  # for a stage started by hand to join the run (infra/secret_env.py)
            credentials.enter_context(run_credentials(run_dir, live.redis.config))
        if cfg.run.archive and not cfg.broker.bootstrap_servers and (run_dir / "archive" / "manifest.json").exists():
            # an embedded Redis started with this process: it holds nothing of the run
            resume_from_archive(live.cfg, run_dir, fresh_ledger=live.redis is not None)
        recovering = False
        while True:
            children, trainer = start_stages(live.cfg, config_path, log_dir, recovering)
            monitor = Monitor(live.cfg, printed, printed_evals, started)
            service_lost = False
            try:
                stopped_by = follow(live.cfg, live, children, trainer, monitor)
                # the archiver and the trackers keep the last evaluation too
                stop_stages(children, trainer, keep=("archiver", "tracker"))
                evals = evaluate_run_end(live.cfg, printed_evals)
                break
            except ServiceLost as lost:
                if live.broker_lost() and not cfg.run.archive:
                    raise RuntimeError(f"{lost}, and run.archive is off: nothing to resume from") from None
                print(f"{lost}: stopping the stages, starting it again and putting back what it held", flush=True)
                service_lost = True
            finally:
                monitor.close()
                stop_stages(children, trainer, service_lost=service_lost)
            recover(live, run_dir)
            recovering = True
        buffer = BufferLedger(live.cfg).balance()
        summary = write_report(run_dir, monitor.lineage, time.monotonic() - started, stopped_by=stopped_by,
                               evals=evals, eval_name=cfg.eval.name, buffer=buffer)
    if buffer["unaccounted"]:
        log.error("the buffer's credit does not balance at the end of the run: %s", buffer)
    print(f"summary: {summary}")
    print(f"wrote {run_dir / 'summary.json'} and {run_dir / 'reward_staleness.png'}")
    return summary
