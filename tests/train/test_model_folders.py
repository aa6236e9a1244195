"""Model folders (model.path) on the trainer's side: a Qwen3-MoE folder keeps routing replay (R3) as the
built-in tiny-moe does (the router hooks find its MoE layers, the engine records every token's experts and
the trainer replays them); trainer.backend=megatron takes a Llama folder and refuses a Qwen3-MoE one."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from model_folders import tiny_llama_folder, tiny_qwen3_moe_folder
from test_routing_replay import PROMPT, experts_used, generate, per_sample, samples_of

from milestream.config import Config, ModelConfig, RolloutConfig
from milestream.engines.engine import CpuEngine
from milestream.engines.moe_routing import routers
from milestream.schemas import routing as wire
from milestream.train.learner import CollectedGroup, Learner


def test_a_qwen3_moe_folder_records_and_replays_routing(tmp_path: Path) -> None:
    model_cfg = ModelConfig(path=str(tiny_qwen3_moe_folder(tmp_path / "moe")), dtype="float32", lora_rank=0, seed=3)
    engine = CpuEngine(model_cfg, RolloutConfig(max_batch=8), seed=5)
    try:
        assert len(routers(engine.model)) == 2  # one per layer of the folder's model
        group = generate(engine, [PROMPT] * 4, max_new_tokens=8)
    finally:
        asyncio.run(engine.close())
    assert all(r.routing is not None and r.routing.num_experts == 8 for r in group)
    samples = samples_of(group, PROMPT)
    learner = Learner(Config().with_overrides(model=model_cfg.model_dump(), trainer={"lr": 1e-3}))
    replay = learner._routing(samples)
    with torch.no_grad(), experts_used(learner.backend.model) as calls:
        logp = learner.backend.logprobs(PROMPT, [s.response_ids for s in samples], 1.0, **replay)
    used = per_sample(calls, len(PROMPT), [len(s.response_ids) for s in samples])
    for sample, result, ids in zip(samples, group, used):
        assert np.array_equal(ids, np.sort(result.routing.expert_ids, axis=2))
        assert np.array_equal(wire.expert_ids(sample), ids)
    torch.testing.assert_close(logp, torch.tensor([r.logprobs for r in group]), atol=1e-5, rtol=0)
    figures = learner.train_step([CollectedGroup("g", samples, staleness=0)])
    assert np.isfinite(figures["loss"]) and figures["grad_norm"] > 0


def test_megatron_refuses_a_qwen3_moe_folder_before_any_rank_starts(tmp_path: Path) -> None:
    from milestream.train.backends import launch

    cfg = Config().with_overrides(model={"path": str(tiny_qwen3_moe_folder(tmp_path / "moe")), "lora_rank": 0},
                                  trainer={"backend": "megatron"})
    with pytest.raises(ValueError, match="model.path: Qwen3MoeForCausalLM is not supported by trainer.backend=megatron"):
        launch(cfg, "milestream.train.trainer:run_trainer")


def test_megatron_takes_a_llama_folder_with_full_fine_tuning(tmp_path: Path) -> None:
    from milestream.train.backends.megatron_weights import require_supported

    folder = str(tiny_llama_folder(tmp_path / "llama"))
    require_supported(ModelConfig(path=folder, lora_rank=0))
    with pytest.raises(ValueError, match="set model.lora_rank=0"):
        require_supported(ModelConfig(path=folder, lora_rank=4))
