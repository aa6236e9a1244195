"""Policy loading: identical starts on both sides, the weight-update contract, the model cache."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milestream.config import ModelConfig
from milestream.infra import model as model_lib
from milestream.infra.model import (
    EOS_TOKEN,
    LORA_PROJECTIONS,
    load_model,
    load_tokenizer,
    load_trainable_state_dict,
    trainable_state_dict,
)

TINY_LORA = ModelConfig(name="tiny-random", lora_rank=4, seed=7)


def test_trainer_and_engine_start_identical() -> None:
    trainer = load_model(TINY_LORA, dtype=torch.float32)
    torch.manual_seed(12345)  # whatever else a process did with the global RNG must not matter
    torch.rand(1000)
    engine = load_model(TINY_LORA, dtype=torch.bfloat16)
    trainer_sd, engine_sd = trainable_state_dict(trainer), trainable_state_dict(engine)
    assert trainer_sd.keys() == engine_sd.keys()
    assert all(".lora_A." in n or ".lora_B." in n for n in trainer_sd)
    for name, tensor in trainer_sd.items():
        assert torch.equal(tensor.to(torch.bfloat16), engine_sd[name])
    assert any(t.abs().sum() > 0 for n, t in trainer_sd.items() if ".lora_A." in n)


def test_the_seed_decides_the_initialisation() -> None:
    a = trainable_state_dict(load_model(TINY_LORA, dtype=torch.float32))
    b = trainable_state_dict(load_model(TINY_LORA.model_copy(update={"seed": 8}), dtype=torch.float32))
    assert any(not torch.equal(a[name], b[name]) for name in a)


def test_full_fine_tuning_carries_every_parameter_once() -> None:
    model = load_model(TINY_LORA.model_copy(update={"lora_rank": 0}), dtype=torch.float32)
    state = trainable_state_dict(model)
    assert state.keys() == {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" not in state  # tied to the embedding, which carries it
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_lora_freezes_the_base_and_trains_the_adapters() -> None:
    model = load_model(TINY_LORA, dtype=torch.float32)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(trainable_state_dict(model))
    assert len(trainable) == 2 * 2 * len(LORA_PROJECTIONS)  # A and B, 2 layers, every projection it has


def test_load_trainable_state_dict_casts_and_copies() -> None:
    model = load_model(TINY_LORA, dtype=torch.bfloat16)
    update = {name: torch.randn(t.shape, dtype=torch.float32) for name, t in trainable_state_dict(model).items()}
    load_trainable_state_dict(model, update)
    for name, tensor in trainable_state_dict(model).items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, update[name].to(torch.bfloat16))


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_load_trainable_state_dict_rejects_a_mismatched_update(damage: str) -> None:
    model = load_model(TINY_LORA, dtype=torch.float32)
    update = {name: t.clone() for name, t in trainable_state_dict(model).items()}
    first = next(iter(update))
    if damage == "missing":
        del update[first]
    elif damage == "unexpected":
        update["base_model.model.not_a_layer.lora_A.default.weight"] = torch.zeros(2, 2)
    else:
        update[first] = torch.zeros(3, 3)
    message = {"missing": "1 missing", "unexpected": "1 unexpected", "shape": "shape mismatch"}[damage]
    with pytest.raises(ValueError, match=message):
        load_trainable_state_dict(model, update)


def test_tiny_model_uses_the_smollm2_tokenizer() -> None:
    tokenizer = load_tokenizer(TINY_LORA)
    model = load_model(TINY_LORA, dtype=torch.float32)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert tokenizer.pad_token == EOS_TOKEN


def test_cache_builds_once_and_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    calls: list[Path] = []

    def build(out: Path) -> None:
        calls.append(out)
        (out / "weights").write_text("ok")

    target = tmp_path / "model"
    assert model_lib._cached(target, build) == target
    assert model_lib._cached(target, build) == target
    assert len(calls) == 1 and (target / "weights").read_text() == "ok"

    def broken(out: Path) -> None:
        (out / "partial").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        model_lib._cached(tmp_path / "other", broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_lost_build_race_uses_the_winner(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def racing(out: Path) -> None:
        target.mkdir()  # another process finished first
        (target / "weights").write_text("winner")
        (out / "weights").write_text("loser")

    assert model_lib._cached(target, racing) == target
    assert (target / "weights").read_text() == "winner"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


@pytest.mark.slow
def test_smollm2_loads_with_the_right_eos() -> None:
    cfg = ModelConfig()
    tokenizer = load_tokenizer(cfg)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == EOS_TOKEN
    model = load_model(cfg, dtype=torch.bfloat16)
    base = model.get_base_model()
    assert 134e6 < sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) < 135e6
    assert base.config.eos_token_id == tokenizer.eos_token_id
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
