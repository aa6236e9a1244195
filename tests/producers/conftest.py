"""Fixtures for the rollout side: the tiny random policy, its tokenizer, and engines on it."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from transformers import PreTrainedTokenizerBase

from milestream.config import ModelConfig, RolloutConfig
from milestream.infra.model import load_tokenizer
from milestream.producers.engine import CpuEngine

from holds import Holds

TINY_FP32 = ModelConfig(name="tiny-random", dtype="float32", lora_rank=0, seed=3)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    """The tiny random policy in fp32, full fine-tuning: exact enough for 1e-4 log-prob checks."""
    return TINY_FP32


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(TINY_FP32)


@pytest.fixture
def holds(monkeypatch, tmp_path) -> Holds:
    """Hold points on in this process: an engine can be held between two of its steps."""
    return Holds.enable(monkeypatch, tmp_path)


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
