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
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from milestream.config import ENV_PREFIX, BrokerConfig, Config, RedisConfig

CREDENTIALS_FILE = "credentials.json"


def secret_environment(cfg: Config) -> dict[str, str]:
    """The MILESTREAM__ variables that carry ``cfg``'s secrets (none when it has none)."""
    env = {}
    if cfg.redis.password is not None:
        env[f"{ENV_PREFIX}REDIS__PASSWORD"] = json.dumps(cfg.redis.password.get_secret_value())
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
