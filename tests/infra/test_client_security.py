"""broker.client (librdkafka settings: SASL/SSL) reaches every Kafka client, and MILESTREAM__ variables
reach the configuration. No SASL broker is needed: the tests look at the clients' configuration."""
import ast
import ssl
from pathlib import Path

import certifi
import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from milestream.config import Config, load_config
from milestream.infra.kafka import Admin, KafkaException, RecordConsumer, RecordProducer, client_config
from milestream.infra.security import faust_credentials
from milestream.schemas import topics
from milestream.streams.processor import ProcessorApp, app_id, faust_settings

SASL_SSL = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "trainer",
            "sasl.password": "s3cret", "ssl.ca.location": certifi.where()}
PACKAGE = Path(__file__).resolve().parents[2] / "milestream"


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
], ids=["producer", "consumer", "admin"])
def test_librdkafka_clients_get_the_security_settings(build):
    cfg = cluster_config({**SASL_SSL, "sasl.mechanism": "SCRAM-SHA-999"})
    assert client_config(cfg.broker)["sasl.username"] == "trainer"
    # librdkafka validates its settings when the client is built: this mechanism can only come from broker.client
    with pytest.raises(KafkaException, match="SCRAM-SHA-999"):
        build(cfg)


def test_the_processor_app_gets_sasl_ssl_credentials():
    cfg = cluster_config({**SASL_SSL, "ssl.endpoint.identification.algorithm": "none"})
    app = ProcessorApp(app_id(cfg), **faust_settings(cfg))
    assert [f"{url.host}:{url.port}" for url in app.conf.broker] == cfg.broker.bootstrap_servers.split(",")
    auth = credentials_to_aiokafka_auth(app.conf.broker_credentials, app.conf.ssl_context)  # what aiokafka gets
    assert {k: auth[k] for k in ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password")} \
        == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "trainer",
            "sasl_plain_password": "s3cret"}
    assert auth["ssl_context"].verify_mode == ssl.CERT_REQUIRED and not auth["ssl_context"].check_hostname


def test_faust_credentials_for_each_protocol_and_refusals():
    assert faust_credentials({}) is None and faust_credentials({"linger.ms": "5"}) is None
    plain = credentials_to_aiokafka_auth(faust_credentials(
        {"security.protocol": "sasl_plaintext", "sasl.mechanisms": "PLAIN", "sasl.username": "u", "sasl.password": "p"}))
    assert (plain["security_protocol"], plain["sasl_mechanism"], plain["ssl_context"]) == ("SASL_PLAINTEXT", "PLAIN", None)
    tls = credentials_to_aiokafka_auth(faust_credentials({"security.protocol": "SSL", "ssl.ca.location": certifi.where()}))
    assert tls["security_protocol"] == "SSL" and tls["ssl_context"].check_hostname
    with pytest.raises(ValueError, match=r"sasl.oauthbearer.client.id"):
        faust_credentials({"security.protocol": "SASL_SSL", "sasl.oauthbearer.client.id": "x"})
    with pytest.raises(ValueError, match="OAUTHBEARER"):
        faust_credentials({"security.protocol": "SASL_SSL", "sasl.mechanism": "OAUTHBEARER"})
    with pytest.raises(ValueError, match="security.protocol 'TLS'"):
        faust_credentials({"security.protocol": "tls"})


def _calls(tree: ast.AST, names: set[str]) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in names]


def _called(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == name


def test_every_kafka_client_in_the_package_is_built_from_broker_settings():
    """A guard for clients added later: confluent clients take client_config(...), faust apps faust_settings(...)."""
    built = 0
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for call in _calls(tree, {"Consumer", "Producer", "AdminClient", "AIOKafkaConsumer", "AIOKafkaProducer"}):
            assert call.args and _called(call.args[0], "client_config"), f"{path}:{call.lineno} bypasses client_config"
            built += 1
        for call in _calls(tree, {"App", "ProcessorApp"}):
            assert any(k.arg is None and _called(k.value, "faust_settings") for k in call.keywords), \
                f"{path}:{call.lineno} builds a faust app without faust_settings"
            built += 1
    assert built >= 5
