"""milestream/infra/docker-compose.yml run as it stands, without Docker: every milestream service of the file
as its own process (``python -m milestream.cli`` with the service's command), configured only by the
service's environment from the file, on the session's broker and Redis in place of the cluster's; a few
trainer steps with both rollout workers publishing, then the run's log audited."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import yaml
from holds import Holds
from prometheus_client.parser import text_string_to_metric_families
from stage_runs import print_log_tails

from milestream.config import ENV_PREFIX, Config, load_config
from milestream.infra.faults import HOLD_DIR
from milestream.infra.services import die_with_parent, free_port
from milestream.log.audit import audit_run
from milestream.log.reader import BrokerSource
from milestream.schemas import topics

COMPOSE = Path(__file__).resolve().parents[2] / "milestream" / "infra" / "docker-compose.yml"
SERVICES: dict[str, dict] = yaml.safe_load(COMPOSE.read_text())["services"]  # anchors and merge keys resolved
MILESTREAM = [name for name, s in SERVICES.items() if s["image"].startswith("milestream")]
JOBS = [name for name in MILESTREAM if any(s.get("depends_on", {}).get(name, {}).get("condition")
                                           == "service_completed_successfully" for s in SERVICES.values())]
ROLLOUT = [name for name in MILESTREAM if SERVICES[name]["command"][1] == "rollout"]
FEEDER = next(name for name in MILESTREAM if SERVICES[name]["command"][1] == "load-prompts")
WORKER_IDS = {name: SERVICES[name]["command"][SERVICES[name]["command"].index("--worker-id") + 1] for name in ROLLOUT}
STEPS = 3
# small and fast, through the environment only, as a container is configured
SMALL = {
    "MILESTREAM__MODEL__NAME": "tiny-random",
    "MILESTREAM__MODEL__DTYPE": "float32",
    "MILESTREAM__ROLLOUT__GROUP_SIZE": "4",
    "MILESTREAM__ROLLOUT__MAX_NEW_TOKENS": "6",
    # one group in flight, holding its slots until its last sample is published (group refill): a worker holds
    # at most two credits (that group's and the next one's). Sample refill frees a slot while the sample is
    # scored: a worker held at its first sample could have taken every credit before it was published
    "MILESTREAM__ROLLOUT__MAX_INFLIGHT_SAMPLES": "4",
    "MILESTREAM__ROLLOUT__REFILL": "group",
    "MILESTREAM__TRAINER__BATCH_GROUPS": "2",
    "MILESTREAM__TRAINER__STEPS": str(STEPS),
    "MILESTREAM__TRAINER__CHECKPOINT_EVERY": "2",
    # capacity 2 groups per worker: a held worker keeps at most two, so a worker not held yet finds credit
    "MILESTREAM__BUFFER__CAPACITY_FACTOR": str(len(ROLLOUT)),
    "MILESTREAM__BUFFER__METRICS_INTERVAL_S": "0.5",
    "MILESTREAM__EVAL__NUM_PROMPTS": "4",  # the shared evaluation of version 0 on worker-0
}
PUBLISHED = "worker.sample_published"
Samples = dict[tuple[str, frozenset], float]


def with_option(command: list[str], flag: str, value: str) -> list[str]:
    return [value if i and command[i - 1] == flag else arg for i, arg in enumerate(command)]


def scrape(port: int) -> Samples:
    """Every sample of the metrics service's endpoint as (name, labels) -> value; empty while it is not up."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except (urllib.error.URLError, ConnectionError):
        return {}
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Deployment:
    """The compose file's milestream services as processes here, each with its log under ``root/logs``."""

    def __init__(self, live: Config, root: Path):
        self.root, self.logs = root, root / "logs"
        self.logs.mkdir()
        self.holds = Holds(root / "holds")
        self.metrics_port = free_port()
        # where the containers find kafka-N, redis and the runs volume, here; and how they log in to them
        password = live.redis.password.get_secret_value() if live.redis.password else None
        self.local = {"MILESTREAM__BROKER__BOOTSTRAP_SERVERS": live.broker.bootstrap_servers,
                      "MILESTREAM__BROKER__CLIENT": json.dumps(live.broker.client),
                      "MILESTREAM__REDIS__URL": live.redis.url,
                      "MILESTREAM__REDIS__PASSWORD": json.dumps(password),
                      "MILESTREAM__RUN__RUN_DIR": str(root / "run")}
        self.prefix = f"compose{os.getpid()}."  # other tests share the session's broker and Redis
        self.procs: dict[str, subprocess.Popen] = {}

    def environment(self, name: str) -> dict[str, str]:
        compose = {key: str(value) for key, value in SERVICES[name]["environment"].items()}
        assert self.local.keys() <= compose.keys(), f"{name} no longer sets {self.local.keys() - compose.keys()}"
        inherited = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
        return {**inherited, **compose, **self.local, "MILESTREAM__BROKER__TOPIC_PREFIX": self.prefix, **SMALL,
                HOLD_DIR: str(self.holds.directory)}

    def config(self, name: str) -> Config:
        return load_config(environ=self.environment(name))

    def command(self, name: str) -> list[str]:
        command = SERVICES[name]["command"]
        assert command[0] == "milestream", f"{name}: {command}"
        # the metrics service's published port: a free one, on loopback
        command = with_option(with_option(command, "--prometheus-port", str(self.metrics_port)),
                              "--prometheus-addr", "127.0.0.1")
        return [sys.executable, "-m", "milestream.cli", *command[1:]]

    def start(self, name: str) -> None:
        with open(self.logs / f"{name}.log", "w") as out:
            self.procs[name] = subprocess.Popen(self.command(name), env=self.environment(name), cwd=self.root,
                                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                preexec_fn=die_with_parent)

    def run_job(self, name: str, timeout_s: float) -> None:
        self.start(name)
        code = self.procs[name].wait(timeout_s)
        assert code == 0, f"job {name} exited with {code}"

    def check_alive(self, finished: tuple[str, ...] = ()) -> None:
        for name, proc in self.procs.items():
            if name not in JOBS and name not in finished and proc.poll() is not None:
                raise AssertionError(f"service {name} exited with {proc.returncode}")

    def wait_for(self, condition: Callable[[], bool], what: str, timeout_s: float,
                 finished: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.check_alive(finished)
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            time.sleep(0.2)

    def prompt_partitions(self, name: str) -> set[int]:
        """The partitions of ``prompts`` the service's consumer holds, as its log last said."""
        pattern = rf"consumer group \S+ (assigned|revoked) {re.escape(self.prefix)}prompts partitions \[([\d, ]*)\]"
        events = re.findall(pattern, (self.logs / f"{name}.log").read_text(errors="replace"))
        if not events or events[-1][0] == "revoked" or not events[-1][1]:
            return set()
        return {int(p) for p in events[-1][1].split(",")}

    def workers_share_prompts(self) -> bool:
        """Every rollout worker holds partitions of ``prompts``, together all of them, none twice."""
        held = [self.prompt_partitions(name) for name in ROLLOUT]
        partitions = set(range(self.config(FEEDER).broker.partitions))
        return all(held) and sum(map(len, held)) == len(partitions) and set().union(*held) == partitions

    def hold_every_worker(self, timeout_s: float) -> None:
        """A sample from every rollout worker, by construction: with ``PUBLISHED`` armed before there was a
        prompt, the first worker to publish a sample holds there, taking no more credit or prompts, until
        every other worker has published one too. The others find credit (see SMALL) and prompts: the
        feeder's first look-ahead of prompts lies on every partition (the data set and its keys are fixed)."""
        held: dict[int, str] = {}
        while True:
            pid = self.holds.wait_held(PUBLISHED, timeout_s, self.check_alive, besides=held.keys())
            held[pid] = next(name for name in ROLLOUT if self.procs[name].pid == pid)
            if len(held) == len(ROLLOUT):
                break
            self.holds.arm(PUBLISHED)
        for pid in held:
            self.holds.release(PUBLISHED, pid)

    def settled(self) -> bool:
        """The metrics service shows the last step, every engine on its version, and every ack verified."""
        samples = scrape(self.metrics_port)
        engines = {dict(labels)["engine"]: value for (name, labels), value in samples.items()
                   if name == "milestream_weights_engine_version"}
        acks = sum(value for (name, _), value in samples.items() if name == "milestream_weights_applied_total")
        return (samples.get(("milestream_trainer_step", frozenset())) == STEPS
                and engines == dict.fromkeys(WORKER_IDS.values(), STEPS)
                and samples.get(("milestream_verifier_step", frozenset())) == acks)

    def stop(self, grace_s: float) -> dict[str, int]:
        """SIGTERM to every service at once, SIGKILL to those still there after ``grace_s``; the exit codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}


def test_the_compose_services_train_with_every_rollout_worker(live_services, tmp_path):
    cluster = Deployment(live_services, tmp_path)
    try:
        for job in JOBS:  # the topics job, to completion
            cluster.run_job(job, timeout_s=120)
        # the prompt feeder last (compose starts the services in no set order): every worker holds partitions
        # of prompts before there is a prompt. A worker held below polls no more, and a group join would
        # wait for it to rejoin (up to max.poll.interval.ms, minutes)
        for name in MILESTREAM:
            if name not in JOBS and name != FEEDER:
                cluster.start(name)
        cluster.wait_for(cluster.workers_share_prompts, "the rollout workers to share the prompts", 240)
        cluster.holds.arm(PUBLISHED)
        cluster.start(FEEDER)
        cluster.hold_every_worker(timeout_s=240)
        trainer = cluster.procs["trainer"]
        cluster.wait_for(lambda: trainer.poll() is not None, f"the trainer's {STEPS} steps", 300)
        assert trainer.returncode == 0
        cluster.wait_for(cluster.settled, "the metrics service to show the run settled", 120, finished=("trainer",))
        samples = scrape(cluster.metrics_port)
        assert samples[("milestream_verifier_weights_mismatched", frozenset())] == 0
        # as `docker compose stop` stops them: every service finishes on SIGTERM, none needs the SIGKILL
        assert cluster.stop(grace_s=60.0) == dict.fromkeys(cluster.procs, 0)

        cfg = cluster.config("trainer")
        source = BrokerSource(cfg, idle_s=1.0)  # every service has stopped
        source.prefetch((topics.TRAJECTORIES, topics.WEIGHT_VERSIONS, topics.DEADLETTER))
        audit = audit_run(cfg.run.run_dir, source)  # a cluster's log is the brokers', not an archive
        assert audit.exact, audit
        assert audit.steps == audit.step_records == STEPS
        assert audit.groups_trained == STEPS * cfg.trainer.batch_groups
        assert audit.groups_emitted == audit.groups_trained + audit.groups_dropped + audit.groups_buffered
        published_by = {t.worker_id for m in source.messages(topics.TRAJECTORIES) for t in m.records}
        assert published_by == set(WORKER_IDS.values())
        versions = [v.version for m in source.messages(topics.WEIGHT_VERSIONS) for v in m.records]
        assert versions == list(range(1, STEPS + 1))
        assert not source.messages(topics.DEADLETTER)
    except BaseException:
        print_log_tails(cluster.logs)
        raise
    finally:
        cluster.stop(grace_s=30.0)
