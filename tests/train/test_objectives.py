"""The losses of train/losses.py against figures worked out by hand on a few tokens."""
import math
from pathlib import Path

import pytest
import torch

from milestream.config import TrainerConfig
from milestream.train.losses import (ActorCriticLoss, LossInput, PolicyLoss, ValueHead, ValueLoss, log_ratio,
                                     make_loss, mismatch_figures, supervised_loss)
from milestream.train.tensor_ops import token_logprobs

PLUGINS = str(Path(__file__).parents[1] / "plugins")
E = math.e


def policy_batch(logp, rollout, advantages, mask=None, old=None) -> LossInput:
    """One row; pi_old defaults to pi (the trainer's one step a batch), so the PPO ratio is 1."""
    logp = torch.tensor([logp], requires_grad=True)
    return LossInput(logp=logp, old_logp=torch.tensor([old]) if old else logp.detach(),
                     rollout_logp=torch.tensor([rollout]), advantages=torch.tensor([advantages]),
                     mask=torch.tensor([mask or [1.0] * len(advantages)]))


# log pi_old - log pi_rollout = [0, 1, -1]: raw weights 1, e = 2.718, 1/e = 0.368
MISMATCHED = dict(logp=[-1.0, -1.0, -2.0], rollout=[-1.0, -2.0, -1.0], advantages=[1.0, 1.0, 1.0])


def test_truncated_importance_sampling_by_hand():
    batch = policy_batch(**MISMATCHED)
    out = PolicyLoss(clip_eps=0.2, correction="tis", interval=(0.0, 2.0))(batch)
    weights = [1.0, 2.0, 1 / E]  # e clamped to 2
    assert math.isclose(out.loss_sum.item(), -sum(weights), rel_tol=1e-6)  # -A * ratio(=1) * w per token
    assert out.figures["is_corrected_frac"] == 1 and out.tokens == 3
    assert math.isclose(out.figures["is_weight_mean"], sum(weights), rel_tol=1e-6)
    assert out.figures["ratio_mean"] == 3.0 and out.figures["ppo_clip_frac"] == 0
    out.loss_sum.backward()
    # d/dlogp of -A * exp(logp - logp.detach()) * w = -A * w
    assert torch.allclose(batch.logp.grad, -torch.tensor([weights]), atol=1e-6)


def test_clip_or_pop_zeroes_the_tokens_outside_the_interval():
    batch = policy_batch(**MISMATCHED)
    out = PolicyLoss(correction="clip_or_pop", interval=(0.5, 2.0))(batch)
    # e > 2 and 1/e < 0.5 are popped; the first token keeps its weight 1
    assert out.loss_sum.item() == -1.0 and out.figures["is_corrected_frac"] == 2
    assert out.figures["is_weight_mean"] == 1.0 and out.tokens == 3  # popped tokens still count
    out.loss_sum.backward()
    assert torch.equal(batch.logp.grad, torch.tensor([[-1.0, 0.0, 0.0]]))

    inside = policy_batch(**MISMATCHED)
    out = PolicyLoss(correction="clip_or_pop", interval=(0.0, 2.0))(inside)
    # 1/e is inside [0, 2] now: weighted by itself, not clamped; e is still popped
    assert math.isclose(out.loss_sum.item(), -(1 + 1 / E), rel_tol=1e-6)
    out.loss_sum.backward()
    assert torch.allclose(inside.logp.grad, torch.tensor([[-1.0, 0.0, -1 / E]]), atol=1e-6)


def test_no_correction_weighs_every_token_one():
    out = PolicyLoss(correction="none")(policy_batch(**MISMATCHED))
    assert out.loss_sum.item() == -3.0 and out.figures["is_corrected_frac"] == 0
    assert out.figures["is_weight_mean"] == 3.0


def test_mismatch_figures_by_hand():
    mask = torch.ones(1, 3)
    log_weight = log_ratio(torch.tensor([MISMATCHED["logp"]]), torch.tensor([MISMATCHED["rollout"]]), 20.0)
    figures = mismatch_figures(log_weight, mask)
    # log w = [0, 1, -1]: |log w| sums to 2, k1 = sum(-log w) = 0
    assert figures["logprob_diff"] == 2.0 and figures["kl_rollout_train"] == 0.0
    # k3 = w - 1 - log w: 0 + (e - 1 - 1) + (1/e - 1 + 1)
    assert math.isclose(figures["kl_rollout_train_k3"], (E - 2) + 1 / E, rel_tol=1e-6)


def test_mask_excludes_tokens():
    out = PolicyLoss()(policy_batch([-1.0, -3.0], [-1.0, -1.0], [2.0, 2.0], mask=[1.0, 0.0]))
    assert out.loss_sum.item() == -2.0 and out.tokens == 1 and out.figures["is_corrected_frac"] == 0


def test_ppo_clip_per_token():
    # log pi - log pi_old = [0.5, -0.5]: ratios e^0.5 = 1.649, e^-0.5 = 0.607, A = 1, eps = 0.2
    batch = policy_batch([-1.0, -2.0], [-1.5, -1.5], [1.0, 1.0], old=[-1.5, -1.5])
    out = PolicyLoss(clip_eps=0.2)(batch)
    # token 1: max(-1.649, -1.2) = -1.2 (clipped, no gradient); token 2: max(-0.607, -0.8) = -0.607
    assert math.isclose(out.loss_sum.item(), -(1.2 + math.exp(-0.5)), rel_tol=1e-6)
    assert out.figures["ppo_clip_frac"] == 1
    assert math.isclose(out.figures["ratio_mean"], math.exp(0.5) + math.exp(-0.5), rel_tol=1e-6)
    out.loss_sum.backward()
    assert torch.allclose(batch.logp.grad, torch.tensor([[0.0, -math.exp(-0.5)]]), atol=1e-6)


def test_gspo_sequence_ratio_is_the_geometric_mean():
    # the same tokens as above plus a padded third: log s = mean(0.5, -0.5) = 0, s = 1 on both tokens
    batch = policy_batch([-1.0, -2.0, -9.0], [-1.5, -1.5, 0.0], [1.0, 1.0, 0.0], mask=[1.0, 1.0, 0.0],
                         old=[-1.5, -1.5, 0.0])
    out = PolicyLoss(clip_eps=0.2, sequence_ratio=True)(batch)
    assert math.isclose(out.loss_sum.item(), -2.0, abs_tol=1e-6) and out.figures["ppo_clip_frac"] == 0
    out.loss_sum.backward()
    # loss = -2 A s, ds/dlogp_t = s / 2: each token's gradient is -A
    assert torch.allclose(batch.logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]), atol=1e-6)


def test_gspo_clips_the_whole_sequence():
    # log s = mean(0.5, 0.5): s = e^0.5 = 1.649 for both tokens
    raised = dict(logp=[-1.0, -1.0], rollout=[-1.5, -1.5], old=[-1.5, -1.5])
    gain = PolicyLoss(clip_eps=0.2, sequence_ratio=True)(policy_batch(advantages=[1.0, 1.0], **raised))
    assert math.isclose(gain.loss_sum.item(), -2.4, rel_tol=1e-6) and gain.figures["ppo_clip_frac"] == 2
    loss_batch = policy_batch(advantages=[-1.0, -1.0], **raised)
    loss = PolicyLoss(clip_eps=0.2, sequence_ratio=True)(loss_batch)
    # A < 0: max(s, 1.2) = s is unclipped; d(2 s)/dlogp_t = 2 s / 2 = s
    assert math.isclose(loss.loss_sum.item(), 2 * math.exp(0.5), rel_tol=1e-6) and loss.figures["ppo_clip_frac"] == 0
    loss.loss_sum.backward()
    assert torch.allclose(loss_batch.logp.grad, torch.full((1, 2), math.exp(0.5)), atol=1e-6)


def value_batch() -> LossInput:
    # token 1: V 1.0 moved 0.5 from V_old 0.5, clipped to 0.7: 0.5 max(0, (0.7 - 1)^2) = 0.045
    # token 2: V = V_old = 2.0, R 3.0: 0.5 * 1 = 0.5, no clip
    values = torch.tensor([[1.0, 2.0]], requires_grad=True)
    zeros = torch.zeros(1, 2)
    return LossInput(logp=zeros, old_logp=zeros, rollout_logp=zeros, advantages=zeros, mask=torch.ones(1, 2),
                     returns=torch.tensor([[1.0, 3.0]]), values=values, old_values=torch.tensor([[0.5, 2.0]]))


def test_value_loss_clipping_by_hand():
    batch = value_batch()
    out = ValueLoss(clip=0.2)(batch)
    assert math.isclose(out.loss_sum.item(), 0.545, rel_tol=1e-6)
    assert out.figures["value_clip_frac"] == 1 and out.tokens == 2
    out.loss_sum.backward()
    # the clipped branch is flat in V; the other gives V - R = -1
    assert torch.allclose(batch.values.grad, torch.tensor([[0.0, -1.0]]))


def test_ppo_loss_adds_the_weighted_value_loss():
    loss = make_loss(TrainerConfig(advantage_estimator="ppo", value_coef=0.5, value_clip=0.2))
    assert isinstance(loss, ActorCriticLoss)
    out = loss(value_batch())  # policy part: zero advantages, zero loss
    assert math.isclose(out.loss_sum.item(), 0.5 * 0.545, rel_tol=1e-6)
    assert {"value_loss", "ppo_clip_frac"} <= out.figures.keys()


def test_supervised_negative_log_likelihood():
    batch = policy_batch([-1.0, -2.0, -3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], mask=[1.0, 1.0, 0.0])
    out = supervised_loss(batch)
    assert out.loss_sum.item() == 3.0 and out.tokens == 2 and out.figures["nll_mean"] == 3.0
    out.loss_sum.backward()
    assert torch.equal(batch.logp.grad, torch.tensor([[-1.0, -1.0, 0.0]]))


def test_user_loss_hook_by_import_path(monkeypatch):
    monkeypatch.syspath_prepend(PLUGINS)
    loss = make_loss(TrainerConfig(loss="loss_hooks:plain_policy_gradient"))
    out = loss(policy_batch([-1.0, -2.0], [0.0, 0.0], [1.0, -0.5]))
    assert out.loss_sum.item() == -(1.0 * -1.0 + -0.5 * -2.0)  # -(sum A log pi) = 0
    assert out.figures == {"advantage_mean": 0.5} and out.tokens == 2
    with pytest.raises(ValueError, match="trainer.loss"):
        make_loss(TrainerConfig(loss="loss_hooks:missing"))


def test_make_loss_follows_the_config():
    assert make_loss(TrainerConfig()) == PolicyLoss(0.2, "tis", (0.0, 2.0), sequence_ratio=False)
    gspo = make_loss(TrainerConfig(advantage_estimator="gspo", correction="clip_or_pop", clip_eps=3e-4))
    assert gspo == PolicyLoss(3e-4, "clip_or_pop", (0.0, 2.0), sequence_ratio=True)
    assert make_loss(TrainerConfig(objective="supervised")) is supervised_loss


def test_value_head_gives_one_value_a_token():
    head = ValueHead(hidden_size=8)
    assert head(torch.zeros(2, 5, 8)).shape == (2, 5)


def test_token_logprobs_match_log_softmax():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert torch.allclose(token_logprobs(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.75)]]))
