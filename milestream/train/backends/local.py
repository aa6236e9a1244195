"""The single-process backend: the trainer's own model and AdamW, the reference the others must match.

With ``trainer.advantage_estimator: ppo`` it also trains a value head (a linear layer on the last
hidden state; train/losses.py) with the same optimizer. It travels in the checkpoint, not in
the exported weights: the engines never need it. With ``trainer.kl_coef`` or ``kl_loss_coef`` it
gives the reference policy's log-probs: the base model with the LoRA adapters switched off, or
(full fine-tuning) a frozen copy of the initial weights. With ``trainer.entropy_coef`` its forward
also gives the policy's entropy at each position (from the same logits).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from milestream.config import Config
from milestream.train.backends.base import (LossFn, Microbatch, StepResult, apply_update, backward_share,
                                            clip_by_total_norm, compute_context, load_optimizer_state_by_name,
                                            optimizer_state_by_name, trainable_named_parameters)
from milestream.train.logprobs import shared_prompt_forward
from milestream.train.losses import ValueHead
from milestream.train.routing_replay import replayed_forward
from milestream.infra.model import load_model, load_trainable_state_dict, trainable_state_dict
from milestream.infra.on_policy import make_exact


VALUE_HEAD = "value_head"


class LocalBackend:
    rank = 0
    world_size = 1

    def __init__(self, cfg: Config, device: torch.device = torch.device("cpu")):
        self.cfg = cfg
        self.device = device
        self.model = load_model(cfg.model, dtype=torch.float32).to(device).train()  # fp32 master weights
        if cfg.rollout.true_on_policy:  # the forward the CPU engine runs, bit for bit
            make_exact(self.model)
        self.params = trainable_named_parameters(self.model)
        self.value_head: ValueHead | None = None
        if cfg.trainer.advantage_estimator == "ppo":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.model.seed)
                self.value_head = ValueHead(self.model.config.hidden_size).to(device)
            self.params.update({f"{VALUE_HEAD}.{n}": p for n, p in self.value_head.named_parameters()})
        self.reference = None
        if (cfg.trainer.kl_coef or cfg.trainer.kl_loss_coef) and not cfg.model.lora_rank:
            self.reference = load_model(cfg.model, dtype=torch.float32).to(device).requires_grad_(False)
            if cfg.rollout.true_on_policy:
                make_exact(self.reference)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.trainer.lr,
                                           weight_decay=cfg.trainer.weight_decay)

    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float,
                 routing: Sequence[np.ndarray] | None = None) -> Tensor:
        """``routing``: each response's recorded MoE expert ids to replay (train/routing_replay.py)."""
        return self.policy_forward(prompt_ids, responses, temperature, routing)[0]

    def policy_forward(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float,
                       routing: Sequence[np.ndarray] | None = None, values: bool = False,
                       entropy: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The log-probs; with ``values`` the value head's V [G, T] of the state before each response
        token; with ``entropy`` the policy's entropy [G, T] at each response position."""
        if values and self.value_head is None:
            raise ValueError("values need the value head: trainer.advantage_estimator=ppo")
        with compute_context(self.cfg.model, self.device):
            if routing is None:
                out = shared_prompt_forward(self.model, prompt_ids, responses, temperature, values, entropy)
            else:
                out = replayed_forward(self.model, prompt_ids, responses, routing, temperature, values, entropy)
            return out.logp, self.value_head(out.hidden.float()) if values else None, out.entropy

    def reference_logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                           temperature: float) -> Tensor:
        """log pi_ref of the responses, without gradient."""
        with torch.no_grad(), compute_context(self.cfg.model, self.device):
            if self.reference is not None:
                return shared_prompt_forward(self.reference, prompt_ids, responses, temperature)[0]
            with self.model.disable_adapter():  # peft: the base weights are the initial policy
                return shared_prompt_forward(self.model, prompt_ids, responses, temperature)[0]

    def step(self, microbatches: Sequence[Microbatch], loss_fn: LossFn, max_grad_norm: float) -> StepResult:
        self.optimizer.zero_grad(set_to_none=True)
        totals = backward_share(microbatches, loss_fn, rank=0, world_size=1)
        grads = [param.grad for param in self.params.values() if param.grad is not None]
        grad_norm = clip_by_total_norm(grads, grads, max_grad_norm)
        return apply_update(self.optimizer, totals, grad_norm)

    def export_weights(self) -> dict[str, Tensor]:
        return trainable_state_dict(self.model)

    def state_dict(self) -> dict[str, Any]:
        model = {name: tensor.clone() for name, tensor in self.export_weights().items()}
        if self.value_head is not None:
            model.update({f"{VALUE_HEAD}.{n}": t.detach().clone() for n, t in self.value_head.state_dict().items()})
        return {"model": model, "optimizer": optimizer_state_by_name(self.optimizer, list(self.params))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        prefix = f"{VALUE_HEAD}."
        policy = {n: t for n, t in state["model"].items() if not n.startswith(prefix)}
        load_trainable_state_dict(self.model, policy)
        if self.value_head is not None:
            self.value_head.load_state_dict({n[len(prefix):]: t for n, t in state["model"].items()
                                             if n.startswith(prefix)})
        load_optimizer_state_by_name(self.optimizer, list(self.params), state["optimizer"])
