"""FSDP2 data parallelism: every rank holds a shard of each parameter and trains on its share of groups.

``fully_shard`` wraps each decoder layer and then the root (embeddings, final norm, head), on a
1-D device mesh over all ranks. Forward and backward gather a layer's full parameters just in
time; gradients are reduce-scattered back to the shards. Gradients are summed, not averaged,
across ranks, because the loss of each microbatch is already divided by the token count of the
whole batch (the single-process convention): N ranks take the update one process would.

Every rank must issue the same collectives in the same order, whatever its data. So every rank
runs the same number of microbatches (``backward_share`` pads with zero-weighted ones), each
with exactly two forwards (prompt, then responses: see ``logprobs``), and only the last
microbatch reduce-scatters (earlier ones accumulate locally).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from milestream.config import Config
from milestream.train.backends.base import (LossFn, Microbatch, StepResult, apply_update, backward_share,
                                            clip_by_total_norm, compute_context, init_distributed,
                                            load_optimizer_state_by_name, optimizer_state_by_name, sum_across_ranks,
                                            trainable_named_parameters)
from milestream.train.logprobs import shared_prompt_logprobs
from milestream.infra.model import load_model


class FSDP2Backend:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.device = init_distributed()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # every rank builds the same full model from the config (seeded), then keeps its shards
        self.model = load_model(cfg.model, dtype=torch.float32).to(self.device).train()
        self.fsdp_modules = _shard(self.model, mesh)
        self.params = trainable_named_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay)

    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float) -> Tensor:
        width = max(len(response) for response in responses)
        if width == 1:
            # one-token responses need no second forward, but the other ranks may run theirs: a
            # junk token forces it (and its gathers) here too; the junk column is cut off below,
            # so it adds only exact zeros to the gradients
            responses = [[*responses[0], 0], *responses[1:]]
        with compute_context(self.cfg.model, self.device):
            return shared_prompt_logprobs(self.model, prompt_ids, responses, temperature)[:, :width]

    def step(self, microbatches: Sequence[Microbatch], loss_fn: LossFn, max_grad_norm: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        totals = backward_share(microbatches, loss_fn, self.rank, self.world_size, self._sync_only_if_last)
        grads = [param.grad for param in self.params.values() if param.grad is not None]
        grad_norm = clip_by_total_norm(grads, [grad.to_local() for grad in grads], max_grad_norm, dist.group.WORLD)
        return apply_update(self.optimizer, sum_across_ranks(totals), grad_norm)

    def export_weights(self) -> dict[str, Tensor]:
        return {name: _full(param.detach()) for name, param in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        optimizer = optimizer_state_by_name(self.optimizer, list(self.params))
        optimizer["state"] = {name: {key: _full(value) for key, value in values.items()}
                              for name, values in optimizer["state"].items()}
        return {"model": self.export_weights(), "optimizer": optimizer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(_shard_like(state["model"][name], param))
        optimizer = dict(state["optimizer"])
        optimizer["state"] = {name: {key: _shard_like(value, self.params[name]) for key, value in values.items()}
                              for name, values in optimizer["state"].items()}
        load_optimizer_state_by_name(self.optimizer, list(self.params), optimizer)

    def _sync_only_if_last(self, is_last: bool) -> None:
        for module in self.fsdp_modules:
            module.set_requires_gradient_sync(is_last)


def _shard(model: nn.Module, mesh) -> list[FSDPModule]:
    """fully_shard each decoder layer, then the root; gradients summed across ranks."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    modules = [fully_shard(layer, mesh=mesh) for layer in base.model.layers]
    modules.append(fully_shard(model, mesh=mesh))
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        # else a divide factor of 1 becomes a PREMUL_SUM reduction, which gloo lacks
        module.set_force_sum_reduction_for_comms(True)
    return modules


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` laid out as ``like`` is (this rank's shard of it, when ``like`` is a DTensor)."""
    if not isinstance(like, DTensor) or isinstance(full, DTensor) or full.shape != like.shape:
        return full  # a scalar optimizer entry such as Adam's step stays a plain tensor
    return distribute_tensor(full.to(like.device_mesh.device_type), like.device_mesh, like.placements)
