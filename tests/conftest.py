"""Shared fixtures: one real broker (tansu) and one real Redis for the session; every test gets
its own topic and key namespace on them, with the topics created."""
from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from milestream.config import Config
from milestream.infra.kafka import Admin
from milestream.infra.services import services
from milestream.streams.ledger import BufferLedger

_namespaces = itertools.count()


@pytest.fixture(scope="session")
def live_services() -> Iterator[Config]:
    """The embedded broker and Redis, or existing ones named by MILESTREAM_BOOTSTRAP / MILESTREAM_REDIS."""
    base = Config().with_overrides(
        broker={"bootstrap_servers": os.environ.get("MILESTREAM_BOOTSTRAP")},
        redis={"url": os.environ.get("MILESTREAM_REDIS")},
    )
    with services(base) as live:
        yield live


@pytest.fixture
def cfg(live_services: Config, tmp_path) -> Config:
    """A fresh namespace on the shared services, topics created, credit filled, tiny fast settings."""
    prefix = f"t{os.getpid()}-{next(_namespaces)}."
    cfg = live_services.with_overrides(
        broker={"topic_prefix": prefix},
        model={"name": "tiny-random", "dtype": "float32"},
        rollout={"group_size": 4, "max_new_tokens": 6, "max_inflight_samples": 8},
        trainer={"batch_groups": 2, "steps": 3, "checkpoint_every": 1},
        buffer={"metrics_interval_s": 0.5},
        run={"run_dir": str(tmp_path / "run")},
    )
    Admin(cfg.broker).create_topics()
    BufferLedger(cfg).initialise()
    return cfg
