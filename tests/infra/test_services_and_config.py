import subprocess
import sys

import pytest

from milestream.cli import main
from milestream.config import Config, load_config
from milestream.infra.kafka import Admin
from milestream.infra.redis_client import redis_client
from milestream.infra.services import EmbeddedBroker, EmbeddedRedis
from milestream.schemas import topics


def test_embedded_services_start_answer_and_stop():
    broker, server = EmbeddedBroker().start(), EmbeddedRedis(password="p").start()
    try:
        assert Admin(Config().broker.model_copy(update={"bootstrap_servers": broker.bootstrap_servers})).list_topics() == {}
        assert redis_client(server.config).ping()
    finally:
        broker.stop()
        server.stop()
    assert broker.proc.poll() is not None and server.proc.poll() is not None


def test_topics_command_creates_the_catalogue(live_services, capsys):
    prefix = "cli-topics."
    main(["topics", "create", "--bootstrap-servers", live_services.broker.bootstrap_servers,
          "--redis-url", live_services.redis.url, "--set", f"broker.topic_prefix={prefix}"])
    out = capsys.readouterr().out
    assert f"created {len(topics.CATALOGUE)} topics" in out
    listed = Admin(live_services.broker).list_topics()
    for spec in topics.CATALOGUE:
        assert listed[prefix + spec.name] == (live_services.broker.partitions if spec.keyed_partitions else 1)


def test_config_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    cfg = load_config(path, ["trainer.lr=5e-5"])
    assert cfg.trainer.lr == 5e-5 and cfg.rollout.group_size == 4
    assert cfg.buffer_capacity == 8
    assert load_config(None, []).to_yaml() == Config().to_yaml()


def test_config_rejects_unknown_and_inconsistent_knobs():
    with pytest.raises(ValueError, match="extra"):
        load_config(None, ["trainer.learning_rate=1"])
    with pytest.raises(ValueError, match="must contain 1"):
        load_config(None, ["trainer.tis_interval=[1.5, 2.0]"])
    with pytest.raises(ValueError, match="group refill"):
        load_config(None, ["rollout.refill=group", "rollout.max_inflight_samples=2"])


def test_cli_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "milestream.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("run", "rollout", "process", "train", "load-prompts", "topics"):
        assert command in out
