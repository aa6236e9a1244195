"""The training backend interface, and the mechanics every backend shares.

A backend owns the policy's parameters and its optimizer, wherever they live (one process, FSDP2
shards, Megatron tensor-parallel slices). Everything above it (collection, advantages, the loss,
metrics, publishing, checkpoints) talks to it only through ``TrainBackend``.

How a distributed trainer uses it (every rank runs the same program, launched by ``launch``)::

    backend = make_backend(cfg)                      # joins the process group torchrun set up
    while training:
        batch = collect() if backend.rank == 0 else None   # rank 0 alone reads Kafka
        groups = broadcast_batch(batch, backend.rank == 0)   # Arrow bytes, never a pickle (train/trainer.py)
        total_tokens = sum(...)                      # of the whole batch: every rank has it

        def loss_fn(group):
            logp = backend.logprobs(group.prompt_ids, group.responses, temperature)
            terms = policy_loss(logp, ...)           # tensors moved to logp.device
            return terms.loss_sum / total_tokens, {"tokens": terms.tokens, ...}

        result = backend.step(groups, loss_fn, max_grad_norm)   # every rank, same arguments
        weights = backend.export_weights()           # collective; the same full tensors everywhere
        if backend.rank == 0:
            publish(weights, result)                 # only rank 0 writes to Kafka and disk

The loss convention is the single-process one: ``loss_fn`` returns its microbatch's share of the
batch loss, already divided by a denominator of the whole batch (its token count by default; its
samples for the other reductions of train/losses.py, reduce_loss), so the batch loss is the sum
over microbatches. Each backend hands every data-parallel rank its share of the microbatches and
sums (never averages) gradients across ranks, so N ranks take the update one process would take
over the whole batch.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from milestream.config import Config, ModelConfig
from milestream.infra.model import compute_dtype

log = logging.getLogger(__name__)

Microbatch = TypeVar("Microbatch")
LossFn = Callable[[Microbatch], tuple[Tensor, Mapping[str, float]]]


@dataclass(frozen=True)
class StepResult:
    loss: float  # the batch loss: the sum of loss_fn over every microbatch, on every rank
    grad_norm: float  # total gradient norm before clipping
    figures: dict[str, float]  # loss_fn's figures summed over every microbatch, on every rank
    update_skipped: bool = False  # the loss or grad norm was not finite: no step (``apply_update``)


class TrainBackend(Protocol):
    """The policy and its optimizer, however they are distributed.

    Every method is collective: all ranks call it, in the same order, with the same arguments.
    """

    rank: int  # global rank; rank 0 is the one that talks to the outside world
    world_size: int

    def logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                 temperature: float) -> Tensor:
        """[len(responses), longest] per-token log-probs of the responses after the prompt, with
        grad, right-padded (padding positions hold junk: mask them), on the compute device."""

    def step(self, microbatches: Sequence[Microbatch], loss_fn: LossFn, max_grad_norm: float) -> StepResult:
        """One optimizer step over the batch: zero grads, backward through this rank's share of
        ``microbatches``, reduce, clip to ``max_grad_norm``, step (``apply_update``: none when the loss or
        the gradient norm is not finite).

        ``loss_fn(microbatch)`` calls ``logprobs`` and returns (its share of the batch loss,
        {figure: float} to sum over the batch); every call returns the same figure names, and
        none called "loss"."""

    def export_weights(self) -> dict[str, Tensor]:
        """The trainable tensors, full (unsharded) and by Hugging Face name, on every rank; they
        may be views of the live parameters (local): copy them to keep them past the next step."""

    def state_dict(self) -> dict[str, Any]:
        """A snapshot {"model": weights, "optimizer": optimizer state by parameter name}, full and
        by Hugging Face name on every rank, so a checkpoint from one backend loads into any other."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; every rank passes the whole thing."""


def make_backend(cfg: Config) -> TrainBackend:
    """The backend ``cfg.trainer.backend`` names; the distributed ones join torchrun's process group."""
    name = cfg.trainer.backend
    if name == "local":
        from milestream.train.backends.local import LocalBackend
        return LocalBackend(cfg)
    if name == "fsdp2":
        from milestream.train.backends.fsdp2 import FSDP2Backend
        return FSDP2Backend(cfg)
    if name == "megatron":
        from milestream.train.backends.megatron import MegatronBackend
        return MegatronBackend(cfg)
    raise ValueError(f"unknown trainer.backend {name!r}")


def check_backend(cfg: Config) -> None:
    """Refuse, before any stage or rank starts, a model the configured backend cannot train."""
    if cfg.trainer.backend == "megatron":
        from milestream.train.backends.megatron_weights import require_supported
        require_supported(cfg.model)


def init_distributed() -> torch.device:
    """Join the process group torchrun describes in the environment; the compute device of this rank.

    gloo on CPU, NCCL with one GPU per rank (LOCAL_RANK picks it).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("distributed backends run under torchrun: start them through "
                           "milestream.train.backends.launch")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def share(items: Sequence[Microbatch], rank: int, world_size: int) -> list[Microbatch]:
    """This rank's contiguous slice of ``items``; slice sizes differ by at most one."""
    base, extra = divmod(len(items), world_size)
    start = rank * base + min(rank, extra)
    return list(items[start:start + base + (rank < extra)])


def backward_share(microbatches: Sequence[Microbatch], loss_fn: LossFn, rank: int, world_size: int,
                   before_backward: Callable[[bool], None] = lambda is_last: None) -> dict[str, float]:
    """Backward through this rank's share; {"loss": ..., figures...} summed over it.

    Every rank runs the same number of microbatches, those beyond its share scaled by zero, so
    that the collectives inside forward and backward (FSDP's gathers and reductions, Megatron's
    tensor-parallel reductions) stay matched across ranks whatever the batch size.
    """
    if not microbatches:
        raise ValueError("a step needs at least one microbatch")
    mine = share(microbatches, rank, world_size)
    padding = -(-len(microbatches) // world_size) - len(mine)
    weights = [1.0] * len(mine) + [0.0] * padding
    mine += [microbatches[0]] * padding
    totals: dict[str, float] = {}
    for index, (microbatch, weight) in enumerate(zip(mine, weights)):
        loss, figures = loss_fn(microbatch)
        if weight != 1.0:
            loss = loss * weight
        before_backward(index == len(mine) - 1)
        loss.backward()
        for key, value in {**figures, "loss": float(loss.detach())}.items():
            totals[key] = totals.get(key, 0.0) + weight * float(value)
    return totals


def sum_across_ranks(totals: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """``totals`` summed over the ranks of ``group`` (float64, keys in a fixed order)."""
    keys = sorted(totals)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {key: totals[key] for key in keys}
    values = torch.tensor([totals[key] for key in keys], dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(values, group=group)
    return dict(zip(keys, values.tolist()))


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor must live to take part in a collective of ``group`` (NCCL: this rank's GPU)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clip_by_total_norm(grads: Sequence[Tensor], counted: Sequence[Tensor], max_norm: float,
                       group: dist.ProcessGroup | None = None) -> float:
    """Scale ``grads`` in place so that their total norm is at most ``max_norm``; the norm before.

    ``counted`` are this rank's local tensors that make up the norm, every element of the full
    gradient exactly once across the ranks of ``group``. Squares add up in float64, so the norm
    does not depend on how the gradient is split (fp32 norms of halves differ from the fp32 norm
    of the whole by ~1e-6 here); the clip factor then follows torch's clip_grad_norm_ in fp32.
    """
    squares = torch.zeros((), dtype=torch.float64, device=_collective_device(group))
    for tensor in counted:
        squares += tensor.detach().double().square().sum().to(squares.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt().float()
    factor = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
    for grad in grads:
        grad.mul_(factor)
    return float(norm)


def apply_update(optimizer: torch.optim.Optimizer, totals: Mapping[str, float], grad_norm: float) -> StepResult:
    """Step ``optimizer`` unless the batch's loss or gradient norm is not finite; the step's result.

    ``totals`` (with "loss") and ``grad_norm`` are the whole batch's, already reduced across ranks.
    A skipped update drops the gradients and leaves the weights and the optimizer state as they were:
    one poisoned batch (a nan reward, an overflow) would otherwise write nan into every weight and
    into Adam's moments for good. Every rank takes the same decision (one all-reduce of the verdict).
    """
    figures = dict(totals)
    loss = figures.pop("loss")
    skipped = _any_rank(not (math.isfinite(loss) and math.isfinite(grad_norm)))
    if skipped:
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("update skipped: loss %s, grad norm %s (not finite); the weights stay as they were",
                        loss, grad_norm)
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return StepResult(loss=loss, grad_norm=grad_norm, figures=figures, update_skipped=skipped)


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the world (every rank gets the same answer)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    verdict = torch.tensor([float(flag)], device=_collective_device(None))
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    return bool(verdict.item())


@contextmanager
def compute_context(cfg: ModelConfig, device: torch.device) -> Iterator[None]:
    """bf16 autocast when the config asks for it (as the trainer always did); new tensors on ``device``."""
    placement = nullcontext() if device.type == "cpu" else device  # CPU is already where tensors are made
    with placement, torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute_dtype(cfg) == torch.bfloat16):
        yield


def trainable_named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: Sequence[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position, tensors copied.

    ``names`` are the names of the optimizer's parameters, in the order it was given them; shards
    stay shards.
    """
    raw = optimizer.state_dict()
    by_position = [index for group in raw["param_groups"] for index in group["params"]]
    if len(by_position) != len(names):
        raise ValueError(f"optimizer holds {len(by_position)} parameters, {len(names)} names given")
    name_of = dict(zip(by_position, names))
    return {
        "state": {name_of[index]: {key: value.clone() if isinstance(value, Tensor) else value
                                   for key, value in state.items()}
                  for index, state in raw["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in raw["param_groups"]],
    }


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: Sequence[str],
                                 state: Mapping[str, Any]) -> None:
    """Inverse of ``optimizer_state_by_name``: names must be the same set the state was saved with."""
    saved = [name for group in state["param_groups"] for name in group["params"]]
    if sorted(saved) != sorted(names):
        missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise ValueError(f"optimizer state does not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    # torch pairs saved and current parameters by order within each group: saved in this
    # optimizer's own order, the pairing is the identity whatever order the state was saved in
    position = {name: index for index, name in enumerate(names)}
    optimizer.load_state_dict({  # copies: torch would keep same-device tensors and update them in place
        "state": {position[name]: {key: value.clone() if isinstance(value, Tensor) else value
                                   for key, value in values.items()}
                  for name, values in state["state"].items()},
        "param_groups": [{**group, "params": sorted(position[n] for n in group["params"])}
                         for group in state["param_groups"]],
    })
