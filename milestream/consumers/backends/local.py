"""The single-process backend: the trainer's own model and AdamW, the reference the others must match."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from milestream.config import Config
from milestream.consumers.backends.base import (LossFn, Microbatch, StepResult, backward_share, clip_by_total_norm,
                                                compute_context, load_optimizer_state_by_name,
                                                optimizer_state_by_name, step_result, trainable_named_parameters)
from milestream.consumers.logprobs import shared_prompt_logprobs
from milestream.infra.model import load_model, load_trainable_state_dict, trainable_state_dict


class LocalBackend:
    rank = 0
    world_size = 1

    def __init__(self, cfg: Config, device: torch.device = torch.device("cpu")):
        self.cfg = cfg
        self.device = device
        self.model = load_model(cfg.model, dtype=torch.float32).to(device).train()  # fp32 master weights
        self.params = trainable_named_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay)

    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float) -> Tensor:
        with compute_context(self.cfg.model, self.device):
            return shared_prompt_logprobs(self.model, prompt_ids, responses, temperature)

    def step(self, microbatches: Sequence[Microbatch], loss_fn: LossFn, max_grad_norm: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        totals = backward_share(microbatches, loss_fn, rank=0, world_size=1)
        grads = [param.grad for param in self.params.values() if param.grad is not None]
        grad_norm = clip_by_total_norm(grads, grads, max_grad_norm)
        self.optimizer.step()
        return step_result(totals, grad_norm)

    def export_weights(self) -> dict[str, Tensor]:
        return trainable_state_dict(self.model)

    def state_dict(self) -> dict[str, Any]:
        model = {name: tensor.clone() for name, tensor in self.export_weights().items()}
        return {"model": model, "optimizer": optimizer_state_by_name(self.optimizer, list(self.params))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_trainable_state_dict(self.model, state["model"])
        load_optimizer_state_by_name(self.optimizer, list(self.params), state["optimizer"])
