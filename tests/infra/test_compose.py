"""milestream/infra/docker-compose.yml against the configuration the code reads (no Docker engine needed):
services, the KRaft cluster, the topics it gets, every milestream service's command and environment, the
secrets every service is given (the Redis service's own command is run here); and against docker-compose's
own validation. (test_compose_run.py runs the services.)"""
import base64
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import yaml

from milestream.cli import COMMANDS, build_config, build_parser
from milestream.config import ENV_PREFIX, Config, RedisConfig
from milestream.infra.kafka import new_topics
from milestream.infra.redis_client import redis_client
from milestream.infra.services import free_port, terminate
from milestream.schemas import topics

COMPOSE = Path(__file__).resolve().parents[2] / "milestream" / "infra" / "docker-compose.yml"
FILE = yaml.safe_load(COMPOSE.read_text())
SERVICES: dict[str, dict] = FILE["services"]
# the nodes (the kafka-users job runs the same image)
KAFKA = sorted(name for name, s in SERVICES.items() if "KAFKA_PROCESS_ROLES" in s.get("environment", {}))
MILESTREAM = sorted(name for name, s in SERVICES.items() if s["image"].startswith("milestream"))
ROLLOUT = [name for name in MILESTREAM if SERVICES[name]["command"][1] == "rollout"]
CLIENT_LISTENER = "SASL_PLAINTEXT"
# what an operator's .env holds (the file has no defaults: compose refuses to start without them)
SECRETS = {"MILESTREAM_REDIS_PASSWORD": "redis-Test_0", "MILESTREAM_KAFKA_PASSWORD": "kafka-Test_1",
           "MILESTREAM_KAFKA_ADMIN_PASSWORD": "admin-Test_2"}
_REQUIRED_VARIABLE = re.compile(r"\$\{(\w+):\?[^}]*\}")


def interpolated(value: object) -> str:
    """A value of the file as compose gives it to the container, with SECRETS in the environment."""
    return _REQUIRED_VARIABLE.sub(lambda m: SECRETS[m.group(1)], str(value)).replace("$$", "$")


def stage_config(name: str, monkeypatch) -> tuple[Config, object]:
    """The Config the service's own command line and environment give, through the CLI's code path."""
    service = SERVICES[name]
    stray = [key for key in service["environment"] if not key.startswith(ENV_PREFIX)]
    assert not stray, f"{name}: environment {stray} is not milestream configuration"
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, interpolated(value))
    assert service["command"][0] == "milestream", f"{name}: {service['command']}"
    args = build_parser().parse_args(service["command"][1:])
    return build_config(args), args


def kafka_env(name: str) -> dict[str, str]:
    return {k: interpolated(v) for k, v in SERVICES[name]["environment"].items()}


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
    exposed = {port for s in SERVICES.values() for port in s.get("ports", [])}
    assert exposed == {"127.0.0.1:9464:9464"}  # the metrics service, on the host's loopback only
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
        assert env["KAFKA_ADVERTISED_LISTENERS"] == \
            f"{CLIENT_LISTENER}://{name}:{listener_port(name, CLIENT_LISTENER)}"
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
    assert SERVICES["topics"]["depends_on"]["kafka-users"]["condition"] == "service_completed_successfully"
    assert SERVICES["topics"]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in KAFKA:
        assert SERVICES["kafka-users"]["depends_on"][name]["condition"] == "service_healthy"
    for name in set(MILESTREAM) - {"topics"}:
        assert SERVICES[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully", name


@pytest.mark.parametrize("name", MILESTREAM)
def test_each_stage_reads_real_knobs_pointing_at_the_services(name, monkeypatch):
    cfg, args = stage_config(name, monkeypatch)  # load_config forbids unknown knobs
    assert args.command in COMMANDS
    if args.command == "metrics":  # scraped from outside its container, through the host's loopback
        assert args.prometheus_addr == "0.0.0.0" and \
            SERVICES[name]["ports"] == [f"127.0.0.1:{args.prometheus_port}:{args.prometheus_port}"]
    for server in cfg.broker.bootstrap_servers.split(","):
        host, port = server.rsplit(":", 1)
        assert host in KAFKA and int(port) == listener_port(host, CLIENT_LISTENER), f"{name}: {server}"
    assert len(cfg.broker.bootstrap_servers.split(",")) == len(KAFKA)
    redis_url = urlparse(cfg.redis.url)
    assert redis_url.scheme == "redis" and redis_url.hostname == "redis" and redis_url.port == 6379
    assert "redis" in SERVICES[name]["depends_on"]
    assert cfg.redis.password.get_secret_value() == SECRETS["MILESTREAM_REDIS_PASSWORD"]
    # what every stage writes to RUN_DIR/config.yaml, which tool code may read: no secret
    written = cfg.to_yaml()
    assert not [secret for secret in SECRETS.values() if secret in written], f"{name}: a secret in config.yaml"


def jaas_options(login: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', login))


def listener_mechanisms(env: dict[str, str], listener: str) -> dict[str, str]:
    """The SASL mechanisms a listener takes, each with its login (JAAS) configuration."""
    key = f"KAFKA_LISTENER_NAME_{listener.replace('_', '__')}"  # the image reads __ as _ and ___ as -
    return {mechanism: env[f"{key}_{mechanism.replace('-', '___')}_SASL_JAAS_CONFIG"]
            for mechanism in env[f"{key}_SASL_ENABLED_MECHANISMS"].split(",")}


def test_kafka_authenticates_every_connection(monkeypatch):
    """Every listener is SASL and has a login for each mechanism it takes; brokers and controllers log in
    to each other as a user their PLAIN login accepts; the stages log in with SCRAM as the user the
    kafka-users job makes, with the password that job is given."""
    for name in KAFKA:
        env = kafka_env(name)
        protocols = dict(entry.split(":") for entry in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
        listeners = [entry.split("://")[0] for entry in env["KAFKA_LISTENERS"].split(",")]
        assert {protocols[listener] for listener in listeners} == {"SASL_PLAINTEXT"}, name
        for listener, mechanism in ((env["KAFKA_INTER_BROKER_LISTENER_NAME"],
                                     env["KAFKA_SASL_MECHANISM_INTER_BROKER_PROTOCOL"]),
                                    (env["KAFKA_CONTROLLER_LISTENER_NAMES"],
                                     env["KAFKA_SASL_MECHANISM_CONTROLLER_PROTOCOL"])):
            assert mechanism == "PLAIN", (name, listener)
            login = jaas_options(listener_mechanisms(env, listener)[mechanism])
            assert login[f"user_{login['username']}"] == login["password"] == \
                SECRETS["MILESTREAM_KAFKA_ADMIN_PASSWORD"], (name, listener)
    job = SERVICES["kafka-users"]
    script = job["command"][-1]
    arguments = shlex.split(script.replace("\\\n", " "))
    user = arguments[arguments.index("--entity-name") + 1]
    assert "SCRAM-SHA-512=[iterations=8192,password=$$MILESTREAM_KAFKA_PASSWORD]" in script
    assert jaas_options(interpolated(job["environment"]["ADMIN_LOGIN"]))["password"] == \
        SECRETS["MILESTREAM_KAFKA_ADMIN_PASSWORD"]
    for name in MILESTREAM:
        client = stage_config(name, monkeypatch)[0].broker.client
        assert client["security.protocol"] == CLIENT_LISTENER and client["sasl.mechanism"] == "SCRAM-SHA-512"
        for node in KAFKA:
            assert client["sasl.mechanism"] in listener_mechanisms(kafka_env(node), CLIENT_LISTENER)
        assert client["sasl.username"] == user and client["sasl.password"] == SECRETS["MILESTREAM_KAFKA_PASSWORD"]
        assert interpolated(job["environment"]["MILESTREAM_KAFKA_PASSWORD"]) == client["sasl.password"]


REDIS_SERVER = shutil.which("redis-server")


@pytest.mark.skipif(REDIS_SERVER is None, reason="no redis-server on PATH (./scripts/setup installs Debian's)")
def test_the_redis_service_refuses_a_client_without_the_stages_password(monkeypatch, tmp_path):
    """The redis service's own command, run here as compose runs it (on a free port, in a temporary folder):
    a client without the password gets NOAUTH, a stage's configuration gets in, and the password is on no
    command line."""
    service = SERVICES["redis"]
    assert service["command"][:2] == ["sh", "-c"]
    port = free_port()
    script = interpolated(service["command"][2]).replace("redis-server -", f"redis-server - --port {port} "
                                                         f"--dir {tmp_path}", 1)
    environment = {**os.environ, **{key: interpolated(value) for key, value in service["environment"].items()}}
    server = subprocess.Popen(["sh", "-c", script], env=environment, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        for line in server.stdout:  # until it listens (or ends: then the assertions below fail)
            if "Ready to accept connections" in line:
                break
        stage = stage_config("processor", monkeypatch)[0].redis
        local = RedisConfig(url=f"redis://127.0.0.1:{port}/0", password=stage.password)
        assert redis_client(local).ping()
        with pytest.raises(redis.AuthenticationError):
            redis_client(RedisConfig(url=local.url)).ping()
        assert SECRETS["MILESTREAM_REDIS_PASSWORD"] not in Path(f"/proc/{server.pid}/cmdline").read_text()
    finally:
        terminate(server, 5.0)
    health = " ".join(service["healthcheck"]["test"][1:])
    assert "REDISCLI_AUTH" in health and " -a " not in health


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


def docker_compose(compose_file: Path, *args: str,
                   secrets: dict[str, str] = SECRETS) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key not in SECRETS} | secrets
    return subprocess.run([DOCKER_COMPOSE, "-f", str(compose_file), *args], capture_output=True, text=True,
                          timeout=120, env=environment)


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason="no docker-compose binary (Debian bookworm: "
                    "apt-get install --no-install-recommends docker-compose, as scripts/setup does)")
def test_docker_compose_accepts_the_file_and_reads_it_as_these_tests_do(tmp_path):
    # `config` validates against compose's schema, service and volume references; it needs no engine
    checked = docker_compose(COMPOSE, "config", "-q")
    assert checked.returncode == 0, checked.stderr
    resolved = yaml.safe_load(docker_compose(COMPOSE, "config").stdout)["services"]
    assert resolved.keys() == SERVICES.keys()
    for name in MILESTREAM:  # anchors, merge keys and the secrets resolve as they do here
        assert resolved[name]["command"] == SERVICES[name]["command"], name
        assert resolved[name]["environment"] == {k: interpolated(v) for k, v in SERVICES[name]["environment"].items()}, \
            name
        assert resolved[name]["depends_on"] == SERVICES[name]["depends_on"], name
    broken = tmp_path / "docker-compose.yml"  # the validator is a real one: it refuses a dependency condition typo
    broken.write_text(COMPOSE.read_text().replace("service_completed_successfully", "service_completed"))
    refused = docker_compose(broken, "config", "-q")
    assert refused.returncode != 0 and "service_completed" in refused.stderr, refused.stderr
    for missing in SECRETS:  # no default password: without one the file is refused, naming it
        alone = tmp_path / "secrets" / "docker-compose.yml"  # away from any .env beside the real file
        alone.parent.mkdir(exist_ok=True)
        alone.write_text(COMPOSE.read_text())
        refused = docker_compose(alone, "config", "-q", secrets={k: v for k, v in SECRETS.items() if k != missing})
        assert refused.returncode != 0 and f"set {missing}" in refused.stderr, (missing, refused.stderr)
