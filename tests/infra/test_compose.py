"""milestream/infra/docker-compose.yml against the configuration the code reads (no Docker engine needed):
services, the KRaft cluster, the topics it gets, and every milestream service's command and environment;
and against docker-compose's own validation. (test_compose_run.py runs the services.)"""
import base64
import os
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from milestream.cli import COMMANDS, build_config, build_parser
from milestream.config import ENV_PREFIX, Config
from milestream.infra.kafka import new_topics
from milestream.schemas import topics

COMPOSE = Path(__file__).resolve().parents[2] / "milestream" / "infra" / "docker-compose.yml"
FILE = yaml.safe_load(COMPOSE.read_text())
SERVICES: dict[str, dict] = FILE["services"]
KAFKA = sorted(name for name, s in SERVICES.items() if s["image"].startswith("apache/kafka"))
MILESTREAM = sorted(name for name, s in SERVICES.items() if s["image"].startswith("milestream"))
ROLLOUT = [name for name in MILESTREAM if SERVICES[name]["command"][1] == "rollout"]


def stage_config(name: str, monkeypatch) -> tuple[Config, object]:
    """The Config the service's own command line and environment give, through the CLI's code path."""
    service = SERVICES[name]
    stray = [key for key in service["environment"] if not key.startswith(ENV_PREFIX)]
    assert not stray, f"{name}: environment {stray} is not milestream configuration"
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, str(value))
    assert service["command"][0] == "milestream", f"{name}: {service['command']}"
    args = build_parser().parse_args(service["command"][1:])
    return build_config(args), args


def kafka_env(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in SERVICES[name]["environment"].items()}


def listener_port(name: str, listener: str) -> int:
    for entry in kafka_env(name)["KAFKA_LISTENERS"].split(","):
        if entry.startswith(listener + "://"):
            return int(entry.rsplit(":", 1)[1])
    raise AssertionError(f"{name} has no {listener} listener")


def test_every_part_of_the_deployment_is_there():
    assert len(KAFKA) == 3
    assert "redis" in SERVICES and SERVICES["redis"]["image"].startswith("redis:")
    commands = {SERVICES[name]["command"][1] for name in MILESTREAM}
    assert {"topics", "process", "train", "rollout", "load-prompts"} <= commands
    assert len(ROLLOUT) >= 2
    exposed = {port.split(":")[0] for s in SERVICES.values() for port in s.get("ports", [])}
    assert exposed == {"9464"}  # the Prometheus endpoint of the metrics service
    for name, service in SERVICES.items():
        for needed in service.get("depends_on", {}):
            assert needed in SERVICES, f"{name} depends on unknown service {needed}"
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in FILE["volumes"], f"{name}: {volume}"


def test_kafka_is_one_kraft_cluster_with_replication():
    envs = {name: kafka_env(name) for name in KAFKA}
    voters = {f"{env['KAFKA_NODE_ID']}@{name}:{listener_port(name, 'CONTROLLER')}" for name, env in envs.items()}
    for name, env in envs.items():
        assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
        assert set(env["KAFKA_CONTROLLER_QUORUM_VOTERS"].split(",")) == voters
        assert env["KAFKA_ADVERTISED_LISTENERS"] == f"PLAINTEXT://{name}:{listener_port(name, 'PLAINTEXT')}"
        assert len(base64.urlsafe_b64decode(env["CLUSTER_ID"] + "==")) == 16  # a KRaft cluster id is a UUID
        assert int(env["KAFKA_DEFAULT_REPLICATION_FACTOR"]) == int(env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"]) == 3
        assert int(env["KAFKA_MIN_INSYNC_REPLICAS"]) == 2
        assert int(env["KAFKA_MESSAGE_MAX_BYTES"]) >= max(s.max_message_mb for s in topics.CATALOGUE) * 1024 * 1024
    assert len({env["CLUSTER_ID"] for env in envs.values()}) == 1
    assert len({env["KAFKA_NODE_ID"] for env in envs.values()}) == 3


def test_the_topics_job_creates_the_catalogue_replicated(monkeypatch):
    cfg, args = stage_config("topics", monkeypatch)
    assert args.action == "create"
    created = {topic.topic: topic for topic in new_topics(cfg.broker)}
    assert set(created) == {cfg.broker.topic_prefix + spec.name for spec in topics.CATALOGUE}
    for spec in topics.CATALOGUE:
        topic = created[cfg.broker.topic_prefix + spec.name]
        assert topic.replication_factor == 3
        assert topic.num_partitions == (cfg.broker.partitions if spec.keyed_partitions else 1)
        assert int(topic.config["min.insync.replicas"]) == 2
    assert set(SERVICES["topics"]["depends_on"]) >= {*KAFKA, "redis"}
    for name in KAFKA:
        assert SERVICES["topics"]["depends_on"][name]["condition"] == "service_healthy"
    for name in set(MILESTREAM) - {"topics"}:
        assert SERVICES[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully", name


@pytest.mark.parametrize("name", MILESTREAM)
def test_each_stage_reads_real_knobs_pointing_at_the_services(name, monkeypatch):
    cfg, args = stage_config(name, monkeypatch)  # load_config forbids unknown knobs
    assert args.command in COMMANDS
    if args.command == "metrics":  # scraped from outside its container
        assert args.prometheus_addr == "0.0.0.0" and f"{args.prometheus_port}:{args.prometheus_port}" in \
            SERVICES[name]["ports"]
    for server in cfg.broker.bootstrap_servers.split(","):
        host, port = server.rsplit(":", 1)
        assert host in KAFKA and int(port) == listener_port(host, "PLAINTEXT"), f"{name}: {server}"
    assert len(cfg.broker.bootstrap_servers.split(",")) == len(KAFKA)
    redis_url = urlparse(cfg.redis.url)
    assert redis_url.scheme == "redis" and redis_url.hostname == "redis" and redis_url.port == 6379
    assert "redis" in SERVICES[name]["depends_on"]


def test_rollout_and_trainer_share_the_run_folder_and_one_image(monkeypatch):
    worker_ids = [stage_config(name, monkeypatch)[1].worker_id for name in ROLLOUT]
    assert len(set(worker_ids)) == len(ROLLOUT)
    cfg, _ = stage_config("trainer", monkeypatch)
    assert cfg.rollout.num_workers == len(ROLLOUT)
    for name in ["trainer", *ROLLOUT]:
        mounts = {v.split(":")[1] for v in SERVICES[name]["volumes"]}
        assert any(Path(cfg.run.run_dir).is_relative_to(m) for m in mounts), f"{name} cannot see {cfg.run.run_dir}"
    builds = {(SERVICES[n]["image"], SERVICES[n]["build"]["context"], SERVICES[n]["build"]["dockerfile"])
              for n in MILESTREAM}
    assert len(builds) == 1
    _, context, dockerfile = builds.pop()
    dockerfile_text = (COMPOSE.parent / context / dockerfile).read_text()
    assert "pip install" in dockerfile_text and "COPY milestream" in dockerfile_text


DOCKER_COMPOSE = shutil.which("docker-compose")


def docker_compose(compose_file: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DOCKER_COMPOSE, "-f", str(compose_file), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="no docker-compose binary (Debian bookworm: "
                    "apt-get install --no-install-recommends docker-compose, as scripts/setup does)")
def test_docker_compose_accepts_the_file_and_reads_it_as_these_tests_do(tmp_path):
    # `config` validates against compose's schema, service and volume references; it needs no engine
    checked = docker_compose(COMPOSE, "config", "-q")
    assert checked.returncode == 0, checked.stderr
    resolved = yaml.safe_load(docker_compose(COMPOSE, "config").stdout)["services"]
    assert resolved.keys() == SERVICES.keys()
    for name in MILESTREAM:  # anchors and merge keys resolve as yaml.safe_load resolves them here
        assert resolved[name]["command"] == SERVICES[name]["command"], name
        assert resolved[name]["environment"] == {k: str(v) for k, v in SERVICES[name]["environment"].items()}, name
        assert resolved[name]["depends_on"] == SERVICES[name]["depends_on"], name
    broken = tmp_path / "docker-compose.yml"  # the validator is a real one: it refuses a dependency condition typo
    broken.write_text(COMPOSE.read_text().replace("service_completed_successfully", "service_completed"))
    refused = docker_compose(broken, "config", "-q")
    assert refused.returncode != 0 and "service_completed" in refused.stderr, refused.stderr
