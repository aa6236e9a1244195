"""broker.client (librdkafka settings: SASL/SSL) reaches every Kafka client, and MILESTREAM__ variables
reach the configuration. No SASL or TLS broker can be started here (tansu 0.6.0 authenticates no one and
serves no TLS: README, "Authentication"): the tests look at the clients' configuration, which librdkafka
checks when a client is built, the stream processor's consumer-group member and the trainer's record reader
among them (every Kafka client of the package is a librdkafka client)."""
import ast
from pathlib import Path

import certifi
import pytest
from certs import make_certificates

from milestream.config import Config, load_config
from milestream.infra.kafka import (Admin, KafkaException, PositionReader, RecordConsumer, RecordProducer,
                                    SourceConsumer, client_config)
from milestream.schemas import topics
from milestream.streams.groups import source_topics
from milestream.streams.processor import app_id

SASL_SSL = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "trainer",
            "sasl.password": "s3cret", "ssl.ca.location": certifi.where()}
PACKAGE = Path(__file__).resolve().parents[2] / "milestream"
SOURCES = source_topics(teacher=False)


def cluster_config(client: dict[str, str]) -> Config:
    return Config().with_overrides(broker={"bootstrap_servers": "kafka-1:9092,kafka-2:9092,kafka-3:9092",
                                           "client": client},
                                   redis={"url": "redis://redis:6379/0"})


def test_environment_variables_sit_between_the_file_and_the_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.001\n  steps: 7\nbroker:\n  partitions: 2\n")
    environ = {"MILESTREAM__TRAINER__LR": "0.002", "MILESTREAM__BROKER__CLIENT": '{"sasl.username": "u"}',
               "MILESTREAM__BROKER__BOOTSTRAP_SERVERS": "k1:9092,k2:9092", "OTHER": "ignored"}
    cfg = load_config(path, ["trainer.lr=0.003"], environ=environ)
    assert (cfg.trainer.lr, cfg.trainer.steps, cfg.broker.partitions) == (0.003, 7, 2)
    assert cfg.broker.client == {"sasl.username": "u"} and cfg.broker.bootstrap_servers == "k1:9092,k2:9092"
    assert load_config(path, environ=environ).trainer.lr == 0.002
    with pytest.raises(ValueError, match="learning_rate"):
        load_config(None, environ={"MILESTREAM__TRAINER__LEARNING_RATE": "1"})


@pytest.mark.parametrize("build", [
    lambda cfg: RecordProducer(cfg.broker),
    lambda cfg: RecordConsumer(cfg.broker, topics.GROUPS, "g"),
    lambda cfg: Admin(cfg.broker),
    lambda cfg: SourceConsumer(cfg.broker, SOURCES, app_id(cfg)),
    lambda cfg: PositionReader(cfg.broker, "trainer-records"),
], ids=["producer", "consumer", "admin", "processor", "record-reader"])
def test_librdkafka_clients_get_the_security_settings(build):
    cfg = cluster_config({**SASL_SSL, "sasl.mechanism": "SCRAM-SHA-999"})
    assert client_config(cfg.broker)["sasl.username"] == "trainer"
    # librdkafka validates its settings when the client is built: this mechanism can only come from broker.client
    with pytest.raises(KafkaException, match="SCRAM-SHA-999"):
        build(cfg)


def _calls(tree: ast.AST, names: set[str]) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in names]


def _called(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == name


def test_every_kafka_client_in_the_package_is_built_from_broker_settings():
    """A guard for clients added later: every client takes client_config(...)."""
    built = 0
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, {"Consumer", "Producer", "AdminClient"}):
            assert call.args and _called(call.args[0], "client_config"), f"{path}:{call.lineno} bypasses client_config"
            built += 1
    assert built >= 5


@pytest.mark.parametrize("protocol, mechanism", [
    ("SASL_PLAINTEXT", "PLAIN"), ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_SSL", "SCRAM-SHA-512"), ("SSL", None)])
def test_the_processor_and_the_record_reader_take_each_protocol(protocol, mechanism, tmp_path):
    """librdkafka reads the CA, certificate and key files when a client is built; a missing one is named."""
    certs = make_certificates(tmp_path)
    client = {"security.protocol": protocol, "ssl.ca.location": str(certs.ca)}
    if mechanism:
        client |= {"sasl.mechanism": mechanism, "sasl.username": "trainer", "sasl.password": "s3cret"}
    else:  # mutual TLS: a client certificate instead of SASL
        client |= {"ssl.certificate.location": str(certs.client_cert), "ssl.key.location": str(certs.client_key)}
    cfg = cluster_config(client)
    SourceConsumer(cfg.broker, SOURCES, app_id(cfg)).close()
    PositionReader(cfg.broker, "trainer-records").close()
    if not mechanism:
        with pytest.raises(KafkaException, match="ssl.key.location"):
            SourceConsumer(cluster_config({**client, "ssl.key.location": str(tmp_path / "missing.key")}).broker,
                           SOURCES, "g")
