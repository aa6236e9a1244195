"""model.path: a local Hugging Face folder is the policy; a folder that lacks a piece is named up front;
LoRA adapts the projections the model has, and a target it lacks is an error; the context length."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from model_folders import tiny_llama_folder, tiny_qwen3_moe_folder

from milestream.config import ModelConfig
from milestream.infra.model import (LORA_PROJECTIONS, ModelFolderError, context_length, load_model, load_tokenizer,
                                    trainable_state_dict)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("models") / "tiny-llama")


def damaged(folder: Path, tmp_path: Path, *remove: str) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / "damaged"))
    for name in remove:
        (copy / name).unlink()
    return copy


def test_the_folder_is_the_policy_and_wins_over_the_name(folder: Path) -> None:
    cfg = ModelConfig(name="tiny-moe", path=str(folder), lora_rank=0)
    model = load_model(cfg, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 64
    saved = load_model(ModelConfig(name="tiny-random", path=str(folder), lora_rank=0), dtype=torch.float32)
    assert all(torch.equal(t, saved.state_dict()[n]) for n, t in model.state_dict().items())
    assert load_tokenizer(cfg).chat_template and context_length(cfg) == 512
    assert context_length(ModelConfig(name="tiny-random")) == 2048


def test_a_relative_path_is_made_absolute(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(folder.parent)
    assert ModelConfig(path=folder.name).path == str(folder)


@pytest.mark.parametrize(("remove", "named"), [
    (["tokenizer.json"], "a tokenizer"),
    (["chat_template.jinja"], "a chat template"),
    (["config.json"], "config.json"),
    (["model.safetensors"], r"weights \(\*.safetensors\)"),
    (["tokenizer.json", "chat_template.jinja"], "a tokenizer .*; a chat template"),
])
def test_a_folder_missing_a_piece_is_named_before_loading(folder: Path, tmp_path: Path, remove: list[str],
                                                          named: str) -> None:
    cfg = ModelConfig(path=str(damaged(folder, tmp_path, *remove)), lora_rank=0)
    for load in (load_tokenizer, lambda c: load_model(c, dtype=torch.float32), context_length):
        with pytest.raises(ModelFolderError, match=f"model.path {cfg.path} lacks {named}"):
            load(cfg)


def test_no_folder_at_all(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match="no such folder"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "nowhere")))


def test_lora_adapts_the_projections_the_model_has(folder: Path, tmp_path: Path) -> None:
    llama = trainable_state_dict(load_model(ModelConfig(path=str(folder), lora_rank=4), dtype=torch.float32))
    assert {n.split(".")[-4] for n in llama} == set(LORA_PROJECTIONS)
    moe_folder = tiny_qwen3_moe_folder(tmp_path / "moe")
    moe = trainable_state_dict(load_model(ModelConfig(path=str(moe_folder), lora_rank=4), dtype=torch.float32))
    assert {n.split(".")[-4] for n in moe} == {"q_proj", "k_proj", "v_proj", "o_proj"}  # its experts are fused


def test_a_lora_target_the_model_lacks_is_an_error(folder: Path) -> None:
    cfg = ModelConfig(path=str(folder), lora_rank=4, lora_targets=("q_proj", "wq"))
    with pytest.raises(ValueError, match=r"model.lora_targets: \['wq'\] name no linear layer of LlamaForCausalLM; "
                                         r"its linear layers are \['down_proj', .*'v_proj'\]"):
        load_model(cfg, dtype=torch.float32)


def test_a_chat_template_without_an_end_of_turn_token_or_a_broken_config_is_named(folder: Path, tmp_path: Path) -> None:
    copy = damaged(folder, tmp_path)
    (copy / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ModelFolderError, match=f"model.path {copy}: chat template: .* not a special end-of-turn token"):
        load_tokenizer(ModelConfig(path=str(copy)))
    (copy / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=f"model.path {copy}/config.json: "):
        context_length(ModelConfig(path=str(copy)))

