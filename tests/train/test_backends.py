"""The training backends against the single-process reference, on the tiny model, full fine-tuning, fp32.

One entry point (``train_fixed_batches``) runs the same fixed batches through whichever backend
the config names, started by ``launch``: in this process for the reference, under torchrun on two
ranks (gloo) for FSDP2 and for Megatron-core with tensor parallel size 2. The batches have 2, 1
and 3 groups: FSDP2 ranks get one group each, then one rank none (it runs a zero-weighted one),
then unequal shares.

FSDP2 matches bit for bit while every rank backpropagates at most one group per step: the
gradient is then g1 + g2 in both. With two groups on one rank FSDP2 accumulates the two
forwards of the shared-prompt pass one at a time ((a1 + b1) + a2) + b2 where one process sums
(a1 + b1) + (a2 + b2): the last step differs in the last bits, within FSDP2_ATOL.

A second entry point (``poisoned_step``) gives one rank an infinite loss: every rank must skip the update.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from milestream.config import Config
from milestream.train.backends import launch, make_backend
from milestream.train.backends.base import share
from milestream.train.backends.megatron_weights import LlamaShape, hf_to_megatron, megatron_to_hf
from milestream.infra.model import configure_process
from milestream.train import checkpoint

ENTRY = f"{__name__}:train_fixed_batches"  # the ranks find this module through PYTHONPATH (see run)
GROUPS_PER_STEP = (2, 1, 3)
TEMPERATURE = 0.8
FSDP2_ATOL = 1e-7  # weights after the uneven step (they are ~0.1; measured 1e-8)
# Megatron computes the same function with fused and split matmuls, a gathered vocabulary and a
# full forward per row instead of a shared-prompt KV cache: float32 rounding, measured below.
MEGATRON_LOSS_RTOL = 1e-6  # measured 3e-8
MEGATRON_GRAD_NORM_RTOL = 1e-5  # measured 8e-7
MEGATRON_TENSOR_RTOL = 1e-5  # |got - want| / |want| per tensor; measured 3.4e-6 (weights), 6.4e-6 (moments)
# Adam divides by sqrt(v) + eps, so where a gradient is near zero its rounding moves the update by
# up to ~lr: elements are held to 2% of one step (lr 1e-3); measured 6e-6
MEGATRON_WEIGHT_ATOL = 2e-5


@dataclass(frozen=True)
class Group:
    prompt_ids: list[int]
    responses: list[list[int]]
    advantages: torch.Tensor  # [G]
    mask: torch.Tensor  # [G, longest response]


def fixed_batch(step: int) -> list[Group]:
    generator = torch.Generator().manual_seed(1000 + step)
    groups = []
    for _ in range(GROUPS_PER_STEP[step]):
        prompt = torch.randint(0, 2000, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator)
        lengths = torch.randint(1, 7, (3,), generator=generator).tolist()
        responses = [torch.randint(0, 2000, (n,), generator=generator).tolist() for n in lengths]
        mask = torch.zeros(len(responses), max(lengths))
        for row, n in enumerate(lengths):
            mask[row, :n] = 1.0
        groups.append(Group(prompt.tolist(), responses, torch.randn(len(responses), generator=generator), mask))
    return groups


def train_fixed_batches(cfg: Config) -> None:
    """Two steps, a state_dict snapshot checkpointed, the third step; then every rank reloads the
    checkpoint (safetensors + JSON, as a resumed trainer does) and redoes the third."""
    configure_process(cfg.model)  # as the trainer does: one thread, else float sums split differently
    backend = make_backend(cfg)

    def step(index: int):
        batch = fixed_batch(index)
        total_tokens = sum(float(group.mask.sum()) for group in batch)

        return backend.step(batch, lambda group: group_loss(backend, group, total_tokens), cfg.trainer.max_grad_norm)

    results = [step(index) for index in range(len(GROUPS_PER_STEP) - 1)]
    midway = backend.state_dict()
    if backend.rank == 0:
        checkpoint.save(cfg.run.run_dir, checkpoint.TrainerState(step=2), midway)
    if dist.is_initialized():
        dist.barrier()
    results.append(step(len(GROUPS_PER_STEP) - 1))
    weights = {name: tensor.clone() for name, tensor in backend.export_weights().items()}
    backend.load_state_dict(checkpoint.load_latest(cfg.run.run_dir)["backend"])
    replayed = step(len(GROUPS_PER_STEP) - 1)
    replayed_weights = backend.export_weights()  # collective, like every backend method
    if backend.rank == 0:
        torch.save({"results": results, "weights": weights, "midway": midway, "replayed": replayed,
                    "replayed_weights": replayed_weights}, Path(cfg.run.run_dir) / "result.pt")


def group_loss(backend, group: Group, total_tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
    logp = backend.logprobs(group.prompt_ids, group.responses, TEMPERATURE)
    mask, advantages = group.mask.to(logp.device), group.advantages.to(logp.device)
    return -(advantages[:, None] * logp * mask).sum() / total_tokens, {"tokens": float(mask.sum())}


def poisoned_step(cfg: Config) -> None:
    """One step of two groups whose second one's loss is +inf with a finite gradient: on FSDP2 only
    rank 1 sees it. Every rank writes whether it skipped and whether its weights stayed."""
    configure_process(cfg.model)
    backend = make_backend(cfg)
    batch = fixed_batch(0)
    total_tokens = sum(float(group.mask.sum()) for group in batch)
    before = {name: tensor.clone() for name, tensor in backend.export_weights().items()}

    def loss_fn(group: Group):
        loss, figures = group_loss(backend, group, total_tokens)
        return (loss + math.inf if group is batch[1] else loss), figures

    result = backend.step(batch, loss_fn, cfg.trainer.max_grad_norm)
    after = backend.export_weights()
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    torch.save({"skipped": result.update_skipped, "loss": result.loss, "unchanged": unchanged},
               Path(cfg.run.run_dir) / f"poisoned-{backend.rank}.pt")


def config(tmp: Path, backend: str, lora_rank: int = 0) -> Config:
    return Config().with_overrides(
        model={"name": "tiny-random", "dtype": "float32", "lora_rank": lora_rank, "seed": 3},
        trainer={"backend": backend, "lr": 1e-3, "max_grad_norm": 1.0},
        run={"run_dir": str(tmp / backend)},
    )


def launched(tmp: Path, backend: str, entry: str, lora_rank: int = 0) -> Path:
    """The run folder of ``entry`` run on two ranks of ``backend``."""
    cfg = config(tmp, backend, lora_rank)
    cfg.run_path.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
        launch(cfg, entry, nproc=2, timeout_s=300)
    return cfg.run_path


def run(tmp: Path, backend: str, lora_rank: int = 0) -> dict:
    return torch.load(launched(tmp, backend, ENTRY, lora_rank) / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[int], dict]:
    """The single-process run for a LoRA rank (0: full fine-tuning), run once per module."""
    runs: dict[int, dict] = {}

    def get(lora_rank: int) -> dict:
        if lora_rank not in runs:
            runs[lora_rank] = run(tmp_path_factory.mktemp("reference"), "local", lora_rank)
        return runs[lora_rank]
    return get


@pytest.fixture
def reference(references) -> dict:
    return references(0)


def test_reference_replays_from_its_state_dict(reference):
    assert reference["replayed"] == reference["results"][-1]
    assert _max_difference(reference["replayed_weights"], reference["weights"]) == 0.0
    assert reference["results"][0].figures["tokens"] > 0


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_fsdp2_on_two_ranks_matches_the_reference(references, lora_rank, tmp_path):
    reference, fsdp2 = references(lora_rank), run(tmp_path, "fsdp2", lora_rank)
    # one group per rank, then one group and a zero-weighted one: every bit, optimizer state included
    assert fsdp2["results"][:2] == reference["results"][:2]
    assert _max_difference(fsdp2["midway"]["model"], reference["midway"]["model"]) == 0.0
    assert _max_difference(_moments(fsdp2["midway"]), _moments(reference["midway"])) == 0.0
    # two groups on rank 0: the loss (before the update) is still exact, the update is not
    last, expected = fsdp2["results"][-1], reference["results"][-1]
    assert (last.loss, last.figures) == (expected.loss, expected.figures)
    assert last.grad_norm == pytest.approx(expected.grad_norm, rel=1e-6)
    assert _max_difference(fsdp2["weights"], reference["weights"]) < FSDP2_ATOL
    assert fsdp2["replayed"] == fsdp2["results"][-1]
    assert _max_difference(fsdp2["replayed_weights"], fsdp2["weights"]) == 0.0


def test_megatron_tensor_parallel_two_matches_the_reference(reference, tmp_path):
    pytest.importorskip("megatron.core")
    megatron = run(tmp_path, "megatron")
    for got, want in zip(megatron["results"], reference["results"], strict=True):
        assert got.loss == pytest.approx(want.loss, rel=MEGATRON_LOSS_RTOL)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=MEGATRON_GRAD_NORM_RTOL)
        assert got.figures == want.figures
    for got, want in ((megatron["weights"], reference["weights"]),
                      (megatron["midway"]["model"], reference["midway"]["model"])):
        assert _relative_error(got, want) < MEGATRON_TENSOR_RTOL
        assert _max_difference(got, want) < MEGATRON_WEIGHT_ATOL
    assert _relative_error(_moments(megatron["midway"]), _moments(reference["midway"])) < MEGATRON_TENSOR_RTOL
    assert megatron["replayed"] == megatron["results"][-1]
    assert _max_difference(megatron["replayed_weights"], megatron["weights"]) == 0.0


@pytest.mark.parametrize("backend", ["fsdp2", "megatron"])
def test_a_non_finite_loss_on_one_rank_skips_the_update_on_every_rank(backend, tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    folder = launched(tmp_path, backend, f"{__name__}:poisoned_step")
    for rank in range(2):
        result = torch.load(folder / f"poisoned-{rank}.pt", weights_only=False)
        assert result == {"skipped": True, "loss": math.inf, "unchanged": True}, rank


def test_megatron_refuses_lora():
    pytest.importorskip("megatron.core")
    from milestream.train.backends.megatron import MegatronBackend

    with pytest.raises(ValueError, match="lora_rank=0"):
        MegatronBackend(config(Path("unused"), "megatron", lora_rank=4))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_megatron_conversion_round_trip_is_exact(tied, tp_size):
    shape = LlamaShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=3, tied_embeddings=tied)
    hf = _random_llama(shape, hidden=6, ffn=8, vocab=10)
    shards = [hf_to_megatron(hf, shape, tp_size, rank) for rank in range(tp_size)]
    back = megatron_to_hf(shards, shape)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_megatron_qkv_and_fc1_layout():
    """Rank 1 of 2 holds query group 1: its two query heads, its key head, its value head; and its
    halves of gate and up, stacked."""
    shape = LlamaShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=3, tied_embeddings=True)
    hf = _random_llama(shape, hidden=6, ffn=8, vocab=10)
    rank1 = hf_to_megatron(hf, shape, tp_size=2, tp_rank=1)
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    expected_qkv = torch.cat([hf[attn + "q_proj.weight"][6:12], hf[attn + "k_proj.weight"][3:6],
                              hf[attn + "v_proj.weight"][3:6]])
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_qkv.weight"], expected_qkv)
    expected_fc1 = torch.cat([hf[mlp + "gate_proj.weight"][4:], hf[mlp + "up_proj.weight"][4:]])
    assert torch.equal(rank1["decoder.layers.0.mlp.linear_fc1.weight"], expected_fc1)
    assert torch.equal(rank1["decoder.layers.0.self_attention.linear_proj.weight"],
                       hf[attn + "o_proj.weight"][:, 6:])


def test_share_splits_contiguously_and_evenly():
    items = list(range(5))
    assert [share(items, rank, 2) for rank in range(2)] == [[0, 1, 2], [3, 4]]
    assert [share(items[:1], rank, 2) for rank in range(2)] == [[0], []]


def _random_llama(shape: LlamaShape, hidden: int, ffn: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def tensor(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator)

    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hf = {"model.embed_tokens.weight": tensor(vocab, hidden), "model.norm.weight": tensor(hidden)}
    if not shape.tied_embeddings:
        hf["lm_head.weight"] = tensor(vocab, hidden)
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        hf.update({
            prefix + "self_attn.q_proj.weight": tensor(q_rows, hidden),
            prefix + "self_attn.k_proj.weight": tensor(kv_rows, hidden),
            prefix + "self_attn.v_proj.weight": tensor(kv_rows, hidden),
            prefix + "self_attn.o_proj.weight": tensor(hidden, q_rows),
            prefix + "mlp.gate_proj.weight": tensor(ffn, hidden),
            prefix + "mlp.up_proj.weight": tensor(ffn, hidden),
            prefix + "mlp.down_proj.weight": tensor(hidden, ffn),
            prefix + "input_layernorm.weight": tensor(hidden),
            prefix + "post_attention_layernorm.weight": tensor(hidden),
        })
    return hf


def _moments(state: dict) -> dict[str, torch.Tensor]:
    return {f"{name}/{key}": value for name, values in state["optimizer"]["state"].items()
            for key, value in values.items()}


def _max_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(float((got[name].float() - want[name].float()).abs().max()) for name in want)


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The worst tensor's |got - want| / |want| (Frobenius norms)."""
    assert got.keys() == want.keys()
    return max(float((got[name].double() - want[name].double()).norm() / want[name].double().norm().clamp(min=1e-30))
               for name in want)
