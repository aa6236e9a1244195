"""Tiny Hugging Face model folders built offline (random weights, SmolLM2's tokenizer), for model.path."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from milestream.config import ModelConfig
from milestream.infra.model import load_model, load_tokenizer


def _common() -> dict:
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random"))
    return dict(vocab_size=len(tokenizer), max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)


def save_tokenizer(folder: Path) -> None:
    load_tokenizer(ModelConfig(name="tiny-random")).save_pretrained(folder)


def tiny_llama_folder(folder: Path, seed: int = 0) -> Path:
    """A Llama of hidden size 64, 2 layers, untied head, saved with save_pretrained with its tokenizer."""
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, tie_word_embeddings=False, **_common())
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def tiny_random_folder(folder: Path, norm_scale: float = 1.0) -> Path:
    """The built-in tiny-random (model.name, seed 0) as a folder; ``norm_scale`` multiplies its final norm's
    weight, so every logit: > 1 a sharper model of the same preferences, < 1 a flatter one."""
    model = load_model(ModelConfig(name="tiny-random", lora_rank=0), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(norm_scale)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def tiny_qwen3_moe_folder(folder: Path, seed: int = 0) -> Path:
    """A Qwen3-MoE (every layer sparse, 8 experts, top-2), routers drawn wide as in infra/model.py's tiny-moe."""
    config = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=True, **_common())
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder
