"""Shared fixtures: one real broker (tansu) and one real Redis for the session, every test with its own
topic and key namespace on them; the tiny random policy, its tokenizer, and engines on it."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from milestream.config import Config, ModelConfig, RolloutConfig
from milestream.engines.engine import CpuEngine
from milestream.infra.kafka import Admin
from milestream.infra.model import load_tokenizer
from milestream.infra.services import EmbeddedRedis, services
from milestream.streams.ledger import BufferLedger

_namespaces = itertools.count()

# The files that take longest in a whole run (`--durations`), longest first. scripts/test hands files to its
# pytest-xdist workers in collection order (--no-loadscope-reorder; xdist's own order puts files with many
# tests first), so each worker starts on a long file and the short ones fill in at the end, rather than one
# worker finishing alone on a long file. test_vllm.py is not first: .venv-vllm may still be installing then.
LONGEST_FIRST = (
    "test_supervision.py", "log/test_archive.py", "test_distill_loop.py", "test_schedules.py",
    "engines/test_vllm.py", "train/test_backends.py", "test_loop.py", "test_elastic.py", "test_failures.py",
    "test_trackers_loop.py", "engines/test_true_on_policy.py", "streams/test_processor_restart.py",
    "test_async_pays.py", "engines/test_families.py", "observe/test_mismatch.py", "evaluate/test_evaluation.py",
    "test_backpressure.py", "log/test_fork.py", "infra/test_compose_run.py", "observe/test_live_page.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if gone := [name for name in LONGEST_FIRST if not (Path(__file__).parent / name).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names files that are not there: {gone}")
    rank = {f"tests/{name}": place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def live_services() -> Iterator[Config]:
    """The embedded broker and Redis, or existing ones named by MILESTREAM_BOOTSTRAP / MILESTREAM_REDIS.

    This Redis takes no password (unlike the one `milestream run` starts): tests write ``cfg.to_yaml()``,
    which never holds one, and start stages on it. tests/infra/test_redis_auth.py starts its own."""
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("MILESTREAM_REDIS")
        if not redis_url:
            server = EmbeddedRedis(password=None).start()
            stack.callback(os.unlink, server.logfile.name)
            stack.callback(server.stop)
            redis_url = server.url
        base = Config().with_overrides(broker={"bootstrap_servers": os.environ.get("MILESTREAM_BOOTSTRAP")},
                                       redis={"url": redis_url})
        yield stack.enter_context(services(base))


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
        eval={"mode": None},  # off unless a test turns it on: held-out questions would leave the task's stream
    )
    Admin(cfg.broker).create_topics()
    BufferLedger(cfg).initialise()
    return cfg


TINY_FP32 = ModelConfig(name="tiny-random", dtype="float32", lora_rank=0, seed=3)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    """The tiny random policy in fp32, full fine-tuning: exact enough for 1e-4 log-prob checks."""
    return TINY_FP32


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(TINY_FP32)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., CpuEngine]]:
    """Builds CpuEngines (tiny fp32 model unless told otherwise) and closes them after the test."""
    engines: list[CpuEngine] = []

    def make(model_cfg: ModelConfig = TINY_FP32, **kwargs: object) -> CpuEngine:
        engine = CpuEngine(model_cfg, RolloutConfig(), **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        asyncio.run(engine.close())
