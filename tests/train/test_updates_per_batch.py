"""trainer.updates_per_batch on the tiny model: N optimizer steps per batch, each on a minibatch of whole
groups, against pi_old = the policy before the first; N = 1 is the one step with pi_old = pi it was.
The same learner on FSDP2 (two gloo ranks) matches the local backend."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from batches import group, tiny

from milestream.config import Config
from milestream.infra.model import configure_process
from milestream.train.backends import launch
from milestream.train.learner import CollectedGroup, Learner, PromptRows, minibatches
from milestream.train.logprobs import pad
from milestream.train.losses import Denominators, LossInput, LossOutput, reduce_loss

A = [(3, 1.0), (1, -2.0)]  # (response length, reward) per sample: rows -3, +2 with raw rewards
B = [(2, 0.5), (2, 0.0)]  # rows -1, 0


@dataclass
class Seen:
    """What the loss was given, one entry per microbatch in the order the updates ran them."""

    loss: object
    inputs: list[LossInput]

    def __call__(self, batch: LossInput) -> LossOutput:
        self.inputs.append(batch)
        return self.loss(batch)


def watched(cfg: Config) -> tuple[Learner, Seen]:
    learner = Learner(cfg)
    seen = Seen(learner.loss, [])
    learner.loss = seen
    return learner, seen


def adam_steps(learner: Learner) -> set[int]:
    return {int(state["step"]) for state in learner.backend.optimizer.state.values()}


def test_two_updates_step_twice_against_the_policy_before_the_first():
    batch = [group("a", [1, 2, 3], A), group("b", [4, 2], B)]
    learner, seen = watched(tiny(updates_per_batch=2, clip_eps=1e-4))
    (_, rows_b) = learner._microbatches(batch)
    with torch.no_grad():
        before_b = learner._forward(rows_b)[0]  # group b under the initial weights
    figures = learner.train_step(batch)
    assert adam_steps(learner) == {2} and figures["updates"] == 2.0 and figures["update_skipped"] == 0.0
    first, second = seen.inputs  # one group per update
    # the first update's pi_old is a forward of its own, without gradient: the ratio is exactly 1
    assert torch.equal(first.old_logp, first.logp.detach())
    # the second's is the policy before the first update, which has moved on since: the clip bites
    assert torch.equal(second.old_logp, before_b)
    assert not torch.equal(second.logp.detach(), second.old_logp)
    assert figures["ppo_clip_frac"] > 0.0 and figures["ratio_mean"] != 1.0

    one, _ = watched(tiny(clip_eps=1e-4))
    single = one.train_step(batch)
    assert adam_steps(one) == {1} and single["updates"] == 1.0
    assert single["ppo_clip_frac"] == 0.0 and single["ratio_mean"] == 1.0


@pytest.mark.parametrize("reduction, last_loss", [
    ("token_mean", (-1.0 + 0.0) / 4),  # group b alone: its 4 tokens
    ("sample_mean", (-0.5 + 0.0) / 2),  # its 2 samples
    ("seq_sum", (-1.0 + 0.0) / (2 * 5)),  # its 2 samples x rollout.max_new_tokens
])
def test_each_update_is_a_mean_over_its_minibatch(reduction, last_loss):
    """Raw rewards as advantages, no correction, lr 0 (pi stays pi_old): every token's loss is -A."""
    learner = Learner(tiny(updates_per_batch=2, group_normalize=False, correction="none", loss_reduction=reduction,
                           lr=0.0))
    figures = learner.train_step([group("a", [1, 2, 3], A), group("b", [4, 2], B)])
    assert math.isclose(figures["loss"], last_loss, rel_tol=1e-6)
    # the loss's figures are over the whole batch: 8 tokens, 4 samples
    assert figures["ratio_mean"] == 1.0 and figures["response_len_mean"] == 2.0 and figures["samples"] == 4.0


def test_the_batch_is_cut_into_runs_of_whole_groups_as_even_as_can_be():
    rows = list(range(7))  # stand-ins for the microbatches: group 0 has prompts 0, 1; group 3 has 4, 5
    assert minibatches(rows, [2, 1, 1, 2, 1], 2) == [[0, 1, 2, 3], [4, 5, 6]]  # groups 0-2, 3-4
    assert minibatches(rows, [2, 1, 1, 2, 1], 5) == [[0, 1], [2], [3], [4, 5], [6]]
    assert minibatches(rows, [2, 1, 1, 2, 1], 1) == [rows]


def test_updates_per_batch_is_at_least_one_and_at_most_the_groups_of_a_batch():
    with pytest.raises(ValueError, match="updates_per_batch"):
        Config().with_overrides(trainer={"updates_per_batch": 0})
    with pytest.raises(ValueError, match=r"trainer.batch_groups=4"):
        Config().with_overrides(trainer={"updates_per_batch": 5})
    learner = Learner(tiny(updates_per_batch=2))
    with pytest.raises(ValueError, match="at least 2 groups"):
        learner.train_step([group("a", [1, 2, 3], A)])


@pytest.mark.parametrize("trainer", [{}, {"advantage_estimator": "ppo", "loss_reduction": "sample_mean"}])
def test_one_update_is_the_single_step_with_pi_old_pi(trainer):
    """updates_per_batch=1 against the step written out: one backend.step over every microbatch,
    denominators of the whole batch, pi_old = pi detached. Bit for bit, weights included."""
    cfg = tiny(**trainer)
    batch = [group("a", [1, 2, 3], A), group("b", [4, 2], B)]
    learner, reference = Learner(cfg), Learner(cfg)
    figures = learner.train_step(batch)
    result = reference.backend.step(reference._microbatches(batch), single_step_loss(reference, batch),
                                    cfg.trainer.max_grad_norm)
    assert (figures["loss"], figures["grad_norm"]) == (result.loss, result.grad_norm)
    tokens = result.figures["tokens"]
    assert figures["ratio_mean"] == result.figures["ratio_mean"] / tokens == 1.0
    want = reference.export_weights()
    assert all(torch.equal(want[name], got) for name, got in learner.export_weights().items())


def single_step_loss(learner: Learner, batch: list[CollectedGroup]):
    samples = [s for g in batch for s in g.samples]
    denominators = Denominators(sum(sum(s.loss_mask) for s in samples), len(samples),
                                learner.cfg.rollout.max_new_tokens)

    def loss_fn(rows: PromptRows):
        logp, values, entropy = learner._forward(rows)
        mask = pad([s.loss_mask for s in rows.samples])
        width = mask.shape[1]
        cut = [None if t is None else t[:, :width] for t in (rows.returns, rows.old_values, rows.ref_logp)]
        out = learner.loss(LossInput(logp, logp.detach(), pad([s.logprobs for s in rows.samples]),
                                     rows.advantages[:, :width], mask, returns=cut[0], values=values,
                                     old_values=cut[1], ref_logp=cut[2], entropy=entropy))
        return reduce_loss(out, mask, learner.cfg.trainer.loss_reduction, denominators), \
            {**out.figures, "tokens": float(out.tokens)}
    return loss_fn


def two_batches_of_two_updates(cfg: Config) -> None:
    """The launch entry: two train_steps of four groups, two updates each; rank 0 saves the figures and weights."""
    configure_process(cfg.model)
    learner = Learner(cfg)
    batch = [group("a", [1, 2, 3], A), group("b", [4, 2], B), group("c", [7, 8], [(4, 1.0), (2, 0.3)]),
             group("d", [9], [(3, 0.0), (3, 1.0)])]
    figures = [learner.train_step(batch) for _ in range(2)]
    weights = learner.export_weights()  # collective
    if learner.backend.rank == 0:
        torch.save({"figures": figures, "weights": weights}, Path(cfg.run.run_dir) / "result.pt")


def run_on(backend: str, tmp: Path) -> dict:
    cfg = tiny(backend=backend, updates_per_batch=2, clip_eps=0.01).with_overrides(
        model={"lora_rank": 0, "seed": 3}, run={"run_dir": str(tmp / backend)})
    cfg.run_path.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:  # the ranks import this module
        patch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=os.pathsep)
        launch(cfg, f"{__name__}:two_batches_of_two_updates", nproc=2, timeout_s=300)
    return torch.load(cfg.run_path / "result.pt", weights_only=False)


def test_fsdp2_takes_the_same_updates_as_the_local_backend(tmp_path):
    """One group per rank per update: FSDP2 is bit for bit the local backend (tests/train/test_backends.py)."""
    local, fsdp2 = run_on("local", tmp_path), run_on("fsdp2", tmp_path)
    assert local["figures"][1]["ppo_clip_frac"] > 0.0  # the updates after the first met a moved ratio
    assert fsdp2["figures"] == local["figures"]
    assert local["weights"].keys() == fsdp2["weights"].keys()
    assert all(torch.equal(local["weights"][name], fsdp2["weights"][name]) for name in local["weights"])
