"""Engines behind SGLang's HTTP API hold whole models: a LoRA run's version reaches them with its adapters
merged into the base weights, never as adapter tensors a whole-model loader cannot take."""
from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch

from milestream.config import ModelConfig
from milestream.engines.http_engine import HttpEngine
from milestream.infra.model import load_model, load_trainable_state_dict, merged_weights, trainable_state_dict
from milestream.streams.weights.disk import read_verified_full

LORA = ModelConfig(name="tiny-random", dtype="float32", lora_rank=4, seed=3)
WHOLE = LORA.model_copy(update={"lora_rank": 0})  # what `milestream engine` serves for it
PROBE = torch.tensor([[1, 17, 230, 4051, 9]])


def test_merged_weights_are_what_peft_merges() -> None:
    model = load_model(LORA, dtype=torch.float32)
    load_trainable_state_dict(model, {n: torch.randn_like(t) for n, t in trainable_state_dict(model).items()})
    merged = merged_weights(model)
    plain = trainable_state_dict(copy.deepcopy(model).merge_and_unload())
    assert merged.keys() == plain.keys() and not any("lora_" in n for n in merged)
    assert all(torch.equal(merged[n], plain[n]) for n in plain)
    assert any(n.endswith(".lora_A.default.weight") for n in trainable_state_dict(model))  # the model kept its adapters


def test_a_lora_version_reaches_http_engines_as_whole_merged_weights(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = load_model(LORA, dtype=torch.float32)
    torch.manual_seed(0)
    adapters = {n: torch.randn_like(t) * 0.1 for n, t in trainable_state_dict(trainer).items()}
    load_trainable_state_dict(trainer, adapters)
    posted: list[tuple[Path, int]] = []

    async def post_update(self: HttpEngine, path: Path, version: int) -> None:
        posted.append((path, version))

    monkeypatch.setattr(HttpEngine, "update_weights_from_disk", post_update)
    engine = HttpEngine("http://unused", weights_dir=tmp_path, model=LORA)
    asyncio.run(engine.update_weights(1, adapters))
    (path, version), = posted
    tensors = read_verified_full(path, version)
    server_model = load_model(WHOLE, dtype=torch.float32)
    load_trainable_state_dict(server_model, tensors)  # every name of the whole model, nothing else
    with torch.no_grad():
        served, trained = server_model(PROBE).logits, trainer(PROBE).logits
        base = load_model(WHOLE, dtype=torch.float32)(PROBE).logits
    # x(W + BA) and xW + (xB)A round differently in float32: equal to 1e-4, while the adapters moved logits far more
    torch.testing.assert_close(served, trained, atol=1e-4, rtol=0)
    assert (trained - base).abs().max() > 100 * 1e-4
