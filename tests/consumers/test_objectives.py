import math

import torch

from milestream.consumers.objectives import grpo_advantages, policy_loss, token_logprobs


def test_grpo_advantages_by_hand():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]) / std, atol=1e-5)
    assert torch.equal(grpo_advantages(torch.tensor([1.0, 1.0])), torch.zeros(2))


def test_truncated_importance_sampling_by_hand():
    # train log-probs vs rollout log-probs give raw weights e^0=1, e^1=2.718 (clamped to 2), e^-1=0.368
    logp = torch.tensor([[-1.0, -1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-1.0, -2.0, -1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    terms = policy_loss(logp, rollout, adv, mask, clip_eps=0.2, tis_interval=(0.0, 2.0))
    weights = [1.0, 2.0, math.exp(-1)]
    assert math.isclose(terms.loss_sum.item(), -sum(weights), rel_tol=1e-6)
    assert terms.tis_clipped == 1 and terms.tokens == 3
    assert math.isclose(terms.tis_weight_sum, sum(weights), rel_tol=1e-6)
    assert math.isclose(terms.logprob_diff_sum, 2.0, rel_tol=1e-6)
    terms.loss_sum.backward()
    # d/dlogp of -A * exp(logp - logp.detach()) * w = -A * w
    assert torch.allclose(logp.grad, -torch.tensor([weights]), atol=1e-6)


def test_mask_excludes_tokens():
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    terms = policy_loss(logp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[2.0, 2.0]]),
                        torch.tensor([[1.0, 0.0]]), 0.2, (0.0, 2.0))
    assert terms.loss_sum.item() == -2.0 and terms.tokens == 1 and terms.tis_clipped == 0


def test_token_logprobs_match_log_softmax():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert torch.allclose(token_logprobs(logits, torch.tensor([[1]])), torch.tensor([[math.log(0.75)]]))
