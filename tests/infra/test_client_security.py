"""broker.client (librdkafka settings: SASL/SSL) reaches every Kafka client, and MILESTREAM__ variables
reach the configuration. No SASL or TLS broker can be started here (tansu 0.6.0 authenticates no one and
serves no TLS: README, "Authentication"): the tests look at the clients' configuration, what faust hands
aiokafka included, and take the TLS settings through a real handshake with a TLS server that is not Kafka."""
import ast
import asyncio
import socket
import ssl
from pathlib import Path

import certifi
import pytest
from certs import make_certificates, tls_redis_server
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from milestream.config import Config, load_config
from milestream.infra.kafka import Admin, KafkaException, RecordConsumer, RecordProducer, client_config
from milestream.infra.security import faust_credentials, ssl_context
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


def _clients_of_the_processor(cfg: Config) -> list:
    """The aiokafka producer and consumer faust builds for the processor app (not started: no broker)."""
    async def build() -> list:
        app = ProcessorApp(app_id(cfg), **faust_settings(cfg))
        built = [app.producer._new_producer(), app.consumer._thread._create_worker_consumer(app.transport)]
        clients = [built[0].client, built[1]._client]
        for client in built:
            await client.stop()
        return clients
    return asyncio.run(build())


@pytest.mark.parametrize("protocol, mechanism", [
    ("SASL_PLAINTEXT", "PLAIN"), ("SASL_SSL", "SCRAM-SHA-256"), ("SASL_SSL", "SCRAM-SHA-512"), ("SSL", None)])
def test_the_processor_producer_and_consumer_get_the_security_settings(protocol, mechanism, tmp_path):
    certs = make_certificates(tmp_path)
    client = {"security.protocol": protocol, "ssl.ca.location": str(certs.ca)}
    if mechanism:
        client |= {"sasl.mechanism": mechanism, "sasl.username": "trainer", "sasl.password": "s3cret"}
    else:  # mutual TLS: a client certificate instead of SASL
        client |= {"ssl.certificate.location": str(certs.client_cert), "ssl.key.location": str(certs.client_key)}
    for kafka in _clients_of_the_processor(cluster_config(client)):
        assert kafka._bootstrap_servers == ["kafka-1:9092", "kafka-2:9092", "kafka-3:9092"]
        assert (kafka._security_protocol, kafka._sasl_mechanism if mechanism else None) == (protocol, mechanism)
        if mechanism:
            assert (kafka._sasl_plain_username, kafka._sasl_plain_password) == ("trainer", "s3cret")
        assert (kafka._ssl_context is None) == (protocol == "SASL_PLAINTEXT")
        if kafka._ssl_context is not None:
            assert [ca["subject"] for ca in kafka._ssl_context.get_ca_certs()] == [((("commonName", "milestream-test-ca"),),)]


def test_the_tls_settings_make_a_mutual_tls_handshake_with_a_real_server(tmp_path):
    """No TLS Kafka broker can be started here (README, "Authentication"): a TLS-only Redis that requires a
    client certificate stands in as the server. The context the processor's aiokafka clients get completes the
    handshake and authenticates; without the certificate it is refused. librdkafka loads the same files."""
    with tls_redis_server(tmp_path, "tls-secret") as (port, certs):
        client = {"security.protocol": "SSL", "ssl.ca.location": str(certs.ca),
                  "ssl.certificate.location": str(certs.client_cert), "ssl.key.location": str(certs.client_key)}
        assert _tls_exchange(port, ssl_context(client), b"AUTH tls-secret\r\nPING\r\n").startswith(b"+OK\r\n+PONG")
        without_certificate = {k: v for k, v in client.items() if not k.startswith(("ssl.certificate", "ssl.key"))}
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _tls_exchange(port, ssl_context(without_certificate), b"PING\r\n")
            pytest.fail("a client without a certificate was let in")
    RecordProducer(cluster_config(client).broker)  # librdkafka reads the CA, certificate and key when built
    with pytest.raises(KafkaException, match="ssl.key.location"):
        RecordProducer(cluster_config({**client, "ssl.key.location": str(tmp_path / "missing.key")}).broker)


def _tls_exchange(port: int, context: ssl.SSLContext, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(request)
            answer = b""
            while not answer.endswith(b"\r\n") or answer.count(b"\r\n") < request.count(b"\r\n"):
                chunk = tls.recv(200)
                if not chunk:
                    raise ConnectionError("the server closed the connection")
                answer += chunk
            return answer
