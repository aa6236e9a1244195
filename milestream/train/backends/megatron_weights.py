"""Llama weights between Hugging Face names and Megatron-core's tensor-parallel layout, both ways.

Plain tensor shuffling (no megatron import), so the round trip is testable anywhere, and what the
backend refuses (``require_supported``) is checked before any stage starts. Megatron's
differences from Hugging Face:

- attention: one fused ``linear_qkv`` whose rows are grouped by query group, each group holding
  its query heads, then its key head, then its value head: [q q k v | q q k v | ...]; a
  tensor-parallel rank holds a contiguous run of whole groups;
- SwiGLU: one fused ``linear_fc1`` = [gate; up], each half split by rank before fusing, so
  every rank holds [its gate rows; its up rows];
- column-parallel layers (qkv, fc1, embedding and head over the vocabulary) split rows, row-
  parallel layers (attention output, fc2) split columns, norms are replicated.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from milestream.config import ModelConfig
from milestream.infra.model import model_config

_HF_LAYER = "model.layers.{}."
_MG_LAYER = "decoder.layers.{}."
# (Megatron name, Hugging Face name, dimension split across ranks or None when replicated)
_ONE_TO_ONE = (
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight", 1),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight", 1),
    ("input_layernorm.weight", "input_layernorm.weight", None),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight", None),
)
_QKV, _FC1 = "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"
_Q, _K, _V = "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"
_GATE, _UP = "mlp.gate_proj.weight", "mlp.up_proj.weight"
_EMBEDDING, _HEAD = ("embedding.word_embeddings.weight", "model.embed_tokens.weight"), ("output_layer.weight", "lm_head.weight")
_FINAL_NORM = ("decoder.final_layernorm.weight", "model.norm.weight")


# what converts here: Llama's layout (RMSNorm, SwiGLU, no biases, no per-head q/k norms)
ARCHITECTURES = ("LlamaForCausalLM",)


def require_supported(cfg: ModelConfig) -> None:
    """Refuse, naming the field, a model trainer.backend=megatron cannot train."""
    if cfg.lora_rank > 0:
        raise ValueError("trainer.backend=megatron trains all weights: set model.lora_rank=0")
    config = model_config(cfg)
    architecture = (config.architectures or [type(config).__name__])[0]
    field = "model.path" if cfg.path else "model.name"
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{field}: {architecture} is not supported by trainer.backend=megatron "
                         f"(it converts {', '.join(ARCHITECTURES)})")
    biased = [flag for flag in ("attention_bias", "mlp_bias") if getattr(config, flag, False)]
    if biased:
        raise ValueError(f"{field}: {architecture} with {' and '.join(biased)} is not supported by "
                         "trainer.backend=megatron (its conversion has no biases)")


@dataclass(frozen=True)
class LlamaShape:
    """What the conversion needs to know about the model."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool

    @classmethod
    def from_hf_config(cls, config) -> "LlamaShape":
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                   getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                   bool(config.tie_word_embeddings))

    def check_tensor_parallel(self, tp_size: int, vocab_size: int, ffn_size: int) -> None:
        for what, count in (("key/value heads", self.num_kv_heads), ("attention heads", self.num_heads),
                            ("vocabulary rows", vocab_size), ("MLP rows", ffn_size)):
            if count % tp_size:
                raise ValueError(f"tensor parallel size {tp_size} does not divide the {count} {what}")


def hf_to_megatron(hf: Mapping[str, Tensor], shape: LlamaShape, tp_size: int, tp_rank: int) -> dict[str, Tensor]:
    """Rank ``tp_rank``'s Megatron tensors (contiguous copies) from full Hugging Face ones."""
    def part(tensor: Tensor, dim: int | None) -> Tensor:
        return tensor if dim is None else tensor.chunk(tp_size, dim=dim)[tp_rank]

    out = {_EMBEDDING[0]: part(hf[_EMBEDDING[1]], 0), _FINAL_NORM[0]: hf[_FINAL_NORM[1]]}
    if not shape.tied_embeddings:
        out[_HEAD[0]] = part(hf[_HEAD[1]], 0)
    for layer in range(shape.num_layers):
        hf_prefix, mg_prefix = _HF_LAYER.format(layer), _MG_LAYER.format(layer)
        for mg_name, hf_name, dim in _ONE_TO_ONE:
            out[mg_prefix + mg_name] = part(hf[hf_prefix + hf_name], dim)
        qkv = _fuse_qkv(hf[hf_prefix + _Q], hf[hf_prefix + _K], hf[hf_prefix + _V], shape)
        out[mg_prefix + _QKV] = part(qkv, 0)  # query groups are whole: chunking rows splits by group
        out[mg_prefix + _FC1] = torch.cat([part(hf[hf_prefix + _GATE], 0), part(hf[hf_prefix + _UP], 0)])
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def megatron_to_hf(shards: Sequence[Mapping[str, Tensor]], shape: LlamaShape) -> dict[str, Tensor]:
    """Full Hugging Face tensors from every tensor-parallel rank's Megatron tensors (``shards[rank]``)."""
    def whole(name: str, dim: int | None) -> Tensor:
        return shards[0][name].clone() if dim is None else torch.cat([shard[name] for shard in shards], dim=dim)

    out = {_EMBEDDING[1]: whole(_EMBEDDING[0], 0)}
    for layer in range(shape.num_layers):
        hf_prefix, mg_prefix = _HF_LAYER.format(layer), _MG_LAYER.format(layer)
        for mg_name, hf_name, dim in _ONE_TO_ONE:
            out[hf_prefix + hf_name] = whole(mg_prefix + mg_name, dim)
        q, k, v = _split_qkv(whole(mg_prefix + _QKV, 0), shape)
        out.update({hf_prefix + _Q: q, hf_prefix + _K: k, hf_prefix + _V: v})
        halves = [shard[mg_prefix + _FC1].chunk(2, dim=0) for shard in shards]
        out[hf_prefix + _GATE] = torch.cat([gate for gate, _ in halves])
        out[hf_prefix + _UP] = torch.cat([up for _, up in halves])
    out[_FINAL_NORM[1]] = whole(_FINAL_NORM[0], None)
    if not shape.tied_embeddings:
        out[_HEAD[1]] = whole(_HEAD[0], 0)
    return out


def hf_sources(shape: LlamaShape) -> dict[str, str]:
    """Hugging Face name -> the Megatron tensor that holds it (for per-parameter scalars such as Adam's step)."""
    sources = {_EMBEDDING[1]: _EMBEDDING[0], _FINAL_NORM[1]: _FINAL_NORM[0]}
    if not shape.tied_embeddings:
        sources[_HEAD[1]] = _HEAD[0]
    for layer in range(shape.num_layers):
        hf_prefix, mg_prefix = _HF_LAYER.format(layer), _MG_LAYER.format(layer)
        sources.update({hf_prefix + hf_name: mg_prefix + mg_name for mg_name, hf_name, _ in _ONE_TO_ONE})
        sources.update({hf_prefix + name: mg_prefix + _QKV for name in (_Q, _K, _V)})
        sources.update({hf_prefix + name: mg_prefix + _FC1 for name in (_GATE, _UP)})
    return sources


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: LlamaShape) -> Tensor:
    groups, per_group, hidden = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, q.shape[-1]
    q = q.view(groups, per_group * shape.head_dim, hidden)
    k = k.view(groups, shape.head_dim, hidden)
    v = v.view(groups, shape.head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _split_qkv(qkv: Tensor, shape: LlamaShape) -> tuple[Tensor, Tensor, Tensor]:
    groups, per_group, hidden = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, qkv.shape[-1]
    q, k, v = qkv.view(groups, (per_group + 2) * shape.head_dim, hidden).split(
        [per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)
