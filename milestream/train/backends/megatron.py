"""Megatron-core tensor parallelism: a GPTModel built from the Hugging Face Llama config.

Every rank builds the Hugging Face policy from the config (so all backends start from the same
weights), converts it to Megatron's layout and keeps its tensor-parallel slice
(``megatron_weights``). The world is split into tensor-parallel groups of ``tp_size`` ranks
(default: all of them) and data-parallel replicas across those; each replica trains on its share
of the microbatches and gradients are summed across replicas, the same convention as the other
backends. The optimizer is plain torch AdamW over the local slices (Adam is elementwise, so
slicing does not change it); the gradient norm for clipping is reduced across the slices.

Full fine-tuning only: LoRA adapters are a peft construct on the Hugging Face modules.

megatron-core is written for CUDA. Without it, ``redirect_cuda_to_cpu`` (the one place that
patches anything) points ``torch.cuda.current_device`` at the CPU and gives Megatron an RNG
tracker over the CPU generator; the attention mask is passed explicitly because Megatron's
default causal mask is built on "cuda".
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

with warnings.catch_warnings():
    # one warning per optional CUDA extension it falls back from, on every rank, and its own
    # modules' deprecation notices to each other
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.transformer_config import TransformerConfig

from milestream.config import Config
from milestream.train.backends.base import (LossFn, Microbatch, StepResult, apply_update, backward_share,
                                            clip_by_total_norm, compute_context, init_distributed,
                                            load_optimizer_state_by_name, optimizer_state_by_name, sum_across_ranks)
from milestream.train.backends.megatron_weights import (LlamaShape, hf_sources, hf_to_megatron, megatron_to_hf,
                                                        require_supported)
from milestream.train.logprobs import pad
from milestream.train.tensor_ops import token_logprobs
from milestream.infra.model import load_model, trainable_state_dict

class MegatronBackend:
    def __init__(self, cfg: Config, tp_size: int | None = None):
        require_supported(cfg.model)
        self.cfg = cfg
        self.device = init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_size = tp_size or self.world_size
        _init_model_parallel(self.tp_size, self.device, cfg.model.seed)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank, self.dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

        hf_model = load_model(cfg.model, dtype=torch.float32)
        self.shape = LlamaShape.from_hf_config(hf_model.config)
        self.model = build_gpt_model(hf_model.config, self.tp_size)
        self._load_hf(trainable_state_dict(hf_model))
        del hf_model
        self.model.to(self.device).train()
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay)

    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float) -> Tensor:
        """One forward over prompt + response rows, right-padded: causal attention keeps padding
        out of every real position, so no padding mask is needed."""
        with compute_context(self.cfg.model, self.device):
            rows = pad([list(prompt_ids) + list(response) for response in responses], dtype=torch.long)
            length = rows.shape[1]
            positions = torch.arange(length).expand_as(rows)
            causal = torch.triu(torch.ones(1, 1, length, length, dtype=torch.bool), diagonal=1)  # True: masked
            logits = self.model(rows, positions, causal)  # [G, S, V], gathered over the vocabulary
            start = len(prompt_ids)
            return token_logprobs(logits[:, start - 1:-1] / max(temperature, 1e-6), rows[:, start:])

    def step(self, microbatches: Sequence[Microbatch], loss_fn: LossFn, max_grad_norm: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        totals = backward_share(microbatches, loss_fn, self.dp_rank, self.dp_size)
        grads = self._reduced_grads()
        # slices count once each; tensors replicated across the tensor-parallel group (norms) once in all
        counted = [grad for grad, param in zip(grads, self.params.values())
                   if tensor_parallel.param_is_not_tensor_parallel_duplicate(param)]
        grad_norm = clip_by_total_norm(grads, counted, max_grad_norm, self.tp_group)
        return apply_update(self.optimizer, sum_across_ranks(totals, self.dp_group), grad_norm)

    def export_weights(self) -> dict[str, Tensor]:
        return megatron_to_hf(self._gather({name: param.detach() for name, param in self.params.items()}), self.shape)

    def state_dict(self) -> dict[str, Any]:
        saved = optimizer_state_by_name(self.optimizer, list(self.params))
        state: dict[str, dict[str, Tensor]] = {name: {} for name in hf_sources(self.shape)}
        for key in _state_keys(saved["state"]):
            sliced = {name: values[key] for name, values in saved["state"].items()}
            if _per_element(sliced):
                for hf_name, tensor in megatron_to_hf(self._gather(sliced), self.shape).items():
                    state[hf_name][key] = tensor
            else:  # a per-parameter scalar (Adam's step): each Hugging Face tensor takes its source's
                for hf_name, source in hf_sources(self.shape).items():
                    state[hf_name][key] = sliced[source].clone()
        groups = [{**group, "params": list(state)} for group in saved["param_groups"]]
        return {"model": self.export_weights(), "optimizer": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_hf(state["model"])
        saved = state["optimizer"]
        sources = hf_sources(self.shape)
        local: dict[str, dict[str, Tensor]] = {name: {} for name in self.params}
        for key in _state_keys(saved["state"]):
            full = {name: values[key] for name, values in saved["state"].items()}
            if _per_element(full):
                for name, tensor in hf_to_megatron(full, self.shape, self.tp_size, self.tp_rank).items():
                    local[name][key] = tensor
            else:
                for hf_name, source in sources.items():
                    local[source][key] = full[hf_name].clone()
        groups = [{**group, "params": list(self.params)} for group in saved["param_groups"]]
        load_optimizer_state_by_name(self.optimizer, list(self.params), {"state": local, "param_groups": groups})

    def _load_hf(self, hf: Mapping[str, Tensor]) -> None:
        converted = hf_to_megatron(hf, self.shape, self.tp_size, self.tp_rank)
        result = self.model.load_state_dict(converted, strict=False)
        missing = [name for name in result.missing_keys if not name.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(f"converted weights do not match the Megatron model: missing {missing[:3]}, "
                             f"unexpected {result.unexpected_keys[:3]}")

    def _reduced_grads(self) -> list[Tensor]:
        """Every parameter's gradient (zeros where it got none), summed across data-parallel replicas."""
        grads = []
        for param in self.params.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        if self.dp_size > 1:
            for grad in grads:
                dist.all_reduce(grad, group=self.dp_group)
        return grads

    def _gather(self, local: Mapping[str, Tensor]) -> list[dict[str, Tensor]]:
        """[rank r's tensor by name] for every tensor-parallel rank r; replicated tensors are not sent."""
        shards: list[dict[str, Tensor]] = [{} for _ in range(self.tp_size)]
        for name, tensor in local.items():
            if getattr(self.params[name], "tensor_model_parallel", False):
                parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
            else:
                parts = [tensor] * self.tp_size
            for shard, part in zip(shards, parts):
                shard[name] = part.cpu()
        return shards


def build_gpt_model(hf_config, tp_size: int) -> GPTModel:
    """A Megatron GPTModel with the architecture of a Hugging Face Llama config (random weights)."""
    _check_supported(hf_config)
    shape = LlamaShape.from_hf_config(hf_config)
    shape.check_tensor_parallel(tp_size, hf_config.vocab_size, hf_config.intermediate_size)
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=hf_config.hidden_size, num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=hf_config.attention_dropout, tensor_model_parallel_size=tp_size,
        # random init is wasted (the Hugging Face weights overwrite it) but it is also where
        # Megatron marks tensors as tensor-parallel slices, which gathering and clipping read
        params_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=True,
        # the fused kernels are CUDA extensions; the local spec's plain torch paths need these off
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    return GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_base=hf_config.rope_parameters["rope_theta"],
        share_embeddings_and_output_weights=shape.tied_embeddings,
        parallel_output=False,  # full-vocabulary logits on every rank: log-probs need the whole softmax
    )


def _check_supported(hf_config) -> None:
    unsupported = {
        "model_type": (hf_config.model_type, "llama"),
        "hidden_act": (hf_config.hidden_act, "silu"),
        "attention_bias": (hf_config.attention_bias, False),
        "mlp_bias": (hf_config.mlp_bias, False),
        "rope_parameters.rope_type": (hf_config.rope_parameters.get("rope_type", "default"), "default"),
    }
    wrong = {field: found for field, (found, wanted) in unsupported.items() if found != wanted}
    if wrong:
        raise ValueError(f"the Megatron backend converts plain Llama models only; this config has {wrong}")


def _init_model_parallel(tp_size: int, device: torch.device, seed: int) -> None:
    if device.type == "cpu":
        redirect_cuda_to_cpu()
    if not parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() % tp_size:
            raise ValueError(f"tensor parallel size {tp_size} does not divide the {dist.get_world_size()} ranks")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, create_gloo_process_groups=False)
    # Megatron's named RNG streams; without CUDA the tracker installed above keeps them on the CPU
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def redirect_cuda_to_cpu() -> None:
    """Let megatron-core run without CUDA: its device queries answer "cpu", its RNG tracker forks the
    CPU generator. Process-wide and idempotent; only ever called when there is no GPU."""
    if torch.cuda.is_available():
        raise RuntimeError("redirect_cuda_to_cpu is for machines without CUDA")
    torch.cuda.current_device = lambda: torch.device("cpu")
    megatron_random._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class _CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams (dropout inside tensor-parallel regions) on the CPU generator."""

    def add(self, name: str, seed: int) -> None:
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _state_keys(state: Mapping[str, Mapping[str, Tensor]]) -> list[str]:
    return sorted({key for values in state.values() for key in values})


def _per_element(state: Mapping[str, Tensor]) -> bool:
    """Whether an optimizer state entry is laid out like its parameter (Adam's moments), not a scalar (step)."""
    return all(tensor.dim() > 0 for tensor in state.values())
