"""Secrets reach the processes a stage starts through their environment; a stage started by hand to join a
run reads the run's own credentials from a file only its owner can read.

``milestream run`` writes the configuration every stage reads to RUN_DIR/config.yaml, where tool code
may read it; torchrun ranks and engine fleets get a YAML file too. Those files hold no secret (the
configuration never writes ``redis.password`` nor the secret keys of ``broker.client``), and a command
line is readable by every user of the machine (``ps``). The environment is readable only by the
process's own user (and root), and the stage reads it as ``MILESTREAM__SECTION__KEY`` variables, which
come after the file: the secret lands where the file left null.

The password of the run's embedded Redis is made for the run, so no operator knows it: the run also writes
it to RUN_DIR/credentials.json, created with mode 0600 (readable by the same user and root, who can read the
stages' environment anyway), and removes it when the run ends, with the Redis. A stage started with the
run's config.yaml (or its --run-dir) that has no Redis password of its own reads it there (``joining``).

The control routes of the engine servers, the router and the session service (pause, continue, load a weight
version, open or end a session) take a bearer token (``control_token``): ``run.control_token`` when given (in
the environment, as the Redis password), else the one in RUN_DIR/control.token, which the first process that
needs one creates (mode 0600) and every later one reads. It stays with the folder: an engine started by hand
before the run, and still serving after it, holds the token the run's stages read.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from milestream.config import ENV_PREFIX, BrokerConfig, Config, RedisConfig

CREDENTIALS_FILE = "credentials.json"
CONTROL_TOKEN_FILE = "control.token"


def secret_environment(cfg: Config) -> dict[str, str]:
    """The MILESTREAM__ variables that carry ``cfg``'s secrets (none when it has none)."""
    env = {}
    if cfg.redis.password is not None:
        env[f"{ENV_PREFIX}REDIS__PASSWORD"] = json.dumps(cfg.redis.password.get_secret_value())
    if cfg.run.control_token is not None:
        env[f"{ENV_PREFIX}RUN__CONTROL_TOKEN"] = json.dumps(cfg.run.control_token.get_secret_value())
    if BrokerConfig.SECRET_CLIENT_KEYS & cfg.broker.client.keys():
        # a variable for broker.client replaces the file's whole dict: it carries every key
        env[f"{ENV_PREFIX}BROKER__CLIENT"] = json.dumps(cfg.broker.client)
    return env


def stage_environment(cfg: Config) -> dict[str, str]:
    """This process's environment with ``cfg``'s secrets: for the stage processes it starts."""
    return {**os.environ, **secret_environment(cfg)}


def run_environment(redis_password: str) -> dict[str, str]:
    """The environment for a ``milestream run`` child whose embedded Redis takes ``redis_password``: the caller
    knows it and can read the run's ledger (RUN_DIR/config.yaml never holds it)."""
    return {**os.environ, f"{ENV_PREFIX}REDIS__PASSWORD": json.dumps(redis_password)}


@contextlib.contextmanager
def run_credentials(run_dir: Path, redis: RedisConfig) -> Iterator[Path]:
    """RUN_DIR/credentials.json with the embedded Redis's URL and password while the run lasts."""
    path = run_dir / CREDENTIALS_FILE
    path.unlink(missing_ok=True)  # left by a run that was killed: created anew below, never reused
    # created with its mode: no moment in which another user could open it
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        json.dump({"redis": {"url": redis.url, "password": redis.password.get_secret_value()}}, out)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def joining(cfg: Config) -> Config:
    """``cfg`` with the Redis password of the run in ``run.run_dir`` where it names that run's Redis and has no
    password (a stage started by hand to join a running ``milestream run``); else ``cfg`` as it is."""
    if cfg.redis.url is None or cfg.redis.password is not None:
        return cfg
    try:
        saved = json.loads((cfg.run_path / CREDENTIALS_FILE).read_text())
    except FileNotFoundError:  # no run going on in the folder, or one whose Redis it did not start
        return cfg
    if saved["redis"]["url"] != cfg.redis.url:  # left by a killed run, whose Redis is gone
        return cfg
    return cfg.with_overrides(redis={"password": saved["redis"]["password"]})


@dataclass(frozen=True)
class ControlToken:
    value: str
    source: str  # where a caller finds it: the knob, or the file's path


def control_token(cfg: Config) -> ControlToken:
    """The bearer token of the run's control routes: ``run.control_token``, else RUN_DIR/control.token,
    created (mode 0600) when missing. Processes that create it at once agree: each writes its own file and
    links it to the name, which only the first link takes."""
    if cfg.run.control_token is not None:
        return ControlToken(cfg.run.control_token.get_secret_value(), "run.control_token")
    path = (cfg.run_path / CONTROL_TOKEN_FILE).resolve()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{CONTROL_TOKEN_FILE}.{os.getpid()}")
        staged.unlink(missing_ok=True)  # left by a killed process of the same id
        with os.fdopen(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(secrets.token_urlsafe(32))
        try:
            os.link(staged, path)
        except FileExistsError:  # another process made it first: its token is the folder's
            pass
        finally:
            staged.unlink()
    return ControlToken(path.read_text().strip(), str(path))
