"""Secrets reach the processes a stage starts through their environment, never through a file or argv.

``milestream run`` writes the configuration every stage reads to RUN_DIR/config.yaml, where tool code
may read it; torchrun ranks and engine fleets get a YAML file too. Those files hold no secret (the
configuration never writes ``redis.password`` nor the secret keys of ``broker.client``), and a command
line is readable by every user of the machine (``ps``). The environment is readable only by the
process's own user (and root), and the stage reads it as ``MILESTREAM__SECTION__KEY`` variables, which
come after the file: the secret lands where the file left null.
"""
from __future__ import annotations

import json
import os

from milestream.config import ENV_PREFIX, BrokerConfig, Config


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
