"""Tiny Hugging Face model folders built offline (random weights, SmolLM2's tokenizer), for model.path; and
tokenizers with a chat template in the style of another family (SmolLM2's vocabulary, that family's special
tokens added)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from milestream.config import ModelConfig
from milestream.infra.model import load_model, load_tokenizer

GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# the system prompt goes into the last user turn, as some Mistral templates do: earlier turns re-render
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
           "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}{{ bos_token }}"
           "{% for m in turns %}{% if m['role'] == 'user' %}"
           "{% if loop.last and system is defined %}[INST] {{ system }}\n\n{{ m['content'] }}[/INST]"
           "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
STYLES = {  # template, special tokens added, bos, eos, end of an assistant turn
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>",
               "<|end_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
}


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


def foreign_tokenizer(folder: Path, template: str, added: list[str] = (), bos: str | None = None,
                      eos: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random"))
    special: dict = {"additional_special_tokens": list(added)} if added else {}
    special.update({key: value for key, value in (("bos_token", bos), ("eos_token", eos)) if value})
    tokenizer.add_special_tokens(special)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def styled(folder: Path, style: str) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer with the chat template, special tokens, bos and eos of ``style`` (STYLES), saved in
    ``folder``; "chatml": SmolLM2's own (ChatML, as Qwen's)."""
    if style == "chatml":
        save_tokenizer(folder)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    template, added, bos, eos, _ = STYLES[style]
    return foreign_tokenizer(folder, template, added, bos, eos)


@dataclass(frozen=True)
class Family:
    """A model family's configuration shape, scaled down to hidden size 64, and its chat template's style."""

    model: type[PreTrainedModel]
    config: type[PretrainedConfig]
    shape: dict
    style: str  # a STYLES key, or "chatml"
    router_std: float = 0.0  # MoE: routers drawn this wide (infra/model.py's tiny-moe says why)


_GQA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=32)  # head_dim != 64 / 4
WINDOW = 16  # prompts and generations pass it
FAMILIES = {
    # Llama 3.2 1B: grouped-query attention, tied embeddings; the Llama-3 template, <|eot_id|>
    "llama": Family(LlamaForCausalLM, LlamaConfig, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                        tie_word_embeddings=True), "llama3"),
    # Qwen2.5 0.5B: q/k/v biases, grouped-query attention, tied; ChatML, <|im_end|>
    "qwen2": Family(Qwen2ForCausalLM, Qwen2Config, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                        tie_word_embeddings=True), "chatml"),
    # Qwen3 0.6B: q/k norms, head_dim 128 for hidden 1024 / 16 heads, tied
    "qwen3": Family(Qwen3ForCausalLM, Qwen3Config, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                        tie_word_embeddings=True), "chatml"),
    # Qwen3-30B-A3B: every layer sparse (top-k of many experts), head_dim 128 for hidden 2048 / 32 heads
    "qwen3_moe": Family(Qwen3MoeForCausalLM, Qwen3MoeConfig, dict(
        num_hidden_layers=2, num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False), "chatml", router_std=0.2),
    # Mistral 7B v0.1: every layer a sliding window, untied; [INST] turns ending with the eos </s>
    "mistral": Family(MistralForCausalLM, MistralConfig, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                              sliding_window=WINDOW,
                                                              tie_word_embeddings=False), "mistral"),
    # Gemma 2: sliding and full attention alternating, attention and final logits soft-capped, tied
    "gemma2": Family(Gemma2ForCausalLM, Gemma2Config, dict(
        num_hidden_layers=4, num_key_value_heads=2, sliding_window=WINDOW, query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True), "gemma"),
    # Gemma 3 270M: five sliding-window layers to one full, 4 query heads to 1 kv head of dimension 256, tied;
    # <end_of_turn>
    "gemma3": Family(Gemma3ForCausalLM, Gemma3TextConfig, dict(
        num_hidden_layers=6, num_key_value_heads=1, sliding_window=WINDOW, query_pre_attn_scalar=32,
        layer_types=["sliding_attention"] * 5 + ["full_attention"], tie_word_embeddings=True), "gemma"),
}


def family_folder(folder: Path, family: str, seed: int = 0) -> Path:
    """A random model of ``family`` (FAMILIES) with its tokenizer, saved with save_pretrained."""
    spec = FAMILIES[family]
    tokenizer = styled(folder, spec.style)
    config = spec.config(**_GQA, **spec.shape, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = spec.model(config)
    if spec.router_std:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, spec.router_std)
    model.save_pretrained(folder)
    return folder
