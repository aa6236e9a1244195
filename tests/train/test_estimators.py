"""The advantage estimators of train/estimators.py against figures worked out by hand."""
import math

import pytest
import torch

from milestream.config import Config, TrainerConfig
from milestream.train.estimators import (AdvantageInputs, AdvantageOptions, advantage_options, compute_advantages,
                                         masked_whiten)


def inputs(rewards, groups, mask, **extra) -> AdvantageInputs:
    return AdvantageInputs(torch.tensor(rewards), torch.tensor(groups), torch.tensor(mask), **extra)


def whitened(values: list[float]) -> list[float]:
    """(x - mean) / std with the biased std, the reference for the batch whitening."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / std for v in values]


def test_grpo_by_hand():
    adv = compute_advantages("grpo", inputs([1.0, 0.0, 0.0, 1.0], [0] * 4, [[1.0]] * 4)).advantages
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(adv, torch.tensor([[0.5], [-0.5], [-0.5], [0.5]]) / std, atol=1e-5)


def test_grpo_normalizes_each_group_and_zeroes_padding():
    batch = inputs([1.0, 0.0, 2.0, 2.0], [0, 0, 1, 1], [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv = compute_advantages("grpo", batch).advantages
    # group 0: mean 0.5, unbiased std sqrt(0.5): +-0.707; group 1: no spread, 0
    a = 0.5 / math.sqrt(0.5)
    assert torch.allclose(adv, torch.tensor([[a, a], [-a, 0.0], [0.0, 0.0], [0.0, 0.0]]), atol=1e-5)
    centred = compute_advantages("grpo", batch, AdvantageOptions(group_std_normalize=False)).advantages
    assert torch.equal(centred, torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(compute_advantages("gspo", batch).advantages, adv)  # gspo differs in its loss only


def test_an_episode_of_several_trajectories_counts_once_in_its_group():
    """Episode A is three trajectories (reward 1), B one (reward 0): the group's mean and spread are those of
    [1, 0], as if each episode were one sample; each of A's trajectories gets A's advantage."""
    weights = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0])
    leaves = inputs([1.0, 1.0, 1.0, 0.0], [0] * 4, [[1.0]] * 4, weights=weights)
    episodes = compute_advantages("grpo", inputs([1.0, 0.0], [0, 0], [[1.0]] * 2)).advantages
    assert torch.allclose(compute_advantages("grpo", leaves).advantages,
                          episodes[[0, 0, 0, 1]], atol=1e-6)
    baseline = compute_advantages("reinforce_plus_plus_baseline", leaves, AdvantageOptions()).advantages
    assert torch.allclose(baseline[:3], baseline[0].expand(3, 1)) and (baseline[3] < 0).all()
    lone = inputs([1.0, 1.0], [0, 0], [[1.0]] * 2, weights=torch.tensor([0.5, 0.5]))  # one episode: no spread
    assert torch.equal(compute_advantages("grpo", lone).advantages, torch.zeros(2, 1))


def test_grpo_group_of_one_is_zero():
    assert torch.equal(compute_advantages("grpo", inputs([3.0], [0], [[1.0]])).advantages, torch.zeros(1, 1))


def test_reinforce_plus_plus_by_hand():
    batch = inputs([1.0, 0.0], [0, 1], [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    result = compute_advantages("reinforce_plus_plus", batch, AdvantageOptions(gamma=0.5))
    # row 0: reward 1 on the last token, G = [0.25, 0.5, 1]; row 1: reward 0, G = [0, 0]
    assert torch.allclose(result.returns, torch.tensor([[0.25, 0.5, 1.0], [0.0, 0.0, 0.0]]))
    # whitened over the five masked tokens: mean 0.35, biased variance 0.7 / 5 = 0.14
    w = whitened([0.25, 0.5, 1.0, 0.0, 0.0])
    assert math.isclose(w[0], -0.1 / math.sqrt(0.14), rel_tol=1e-9)
    assert torch.allclose(result.advantages, torch.tensor([w[:3], w[3:] + [0.0]]), atol=1e-5)


def test_reinforce_plus_plus_kl_penalty():
    # kl_coef 0.1, log pi_old - log pi_ref = [1, 2, 0]: token rewards [-0.1, -0.2, 1], gamma 1
    batch = inputs([1.0], [0], [[1.0, 1.0, 1.0]], old_logp=torch.tensor([[-1.0, -1.0, -2.0]]),
                   ref_logp=torch.tensor([[-2.0, -3.0, -2.0]]))
    result = compute_advantages("reinforce_plus_plus", batch, AdvantageOptions(kl_coef=0.1))
    assert torch.allclose(result.returns, torch.tensor([[0.7, 0.8, 1.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        compute_advantages("reinforce_plus_plus", inputs([1.0], [0], [[1.0]]), AdvantageOptions(kl_coef=0.1))


def test_discounting_skips_tokens_off_the_mask():
    # a tool output in the middle is not a step: G = [0.5 * 1, -, 1]
    batch = inputs([1.0, 0.0], [0, 0], [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    returns = compute_advantages("reinforce_plus_plus", batch, AdvantageOptions(gamma=0.5)).returns
    assert torch.equal(returns[0], torch.tensor([0.5, 0.0, 1.0]))


def test_reinforce_plus_plus_baseline_by_hand():
    batch = inputs([1.0, 0.0, 3.0, 3.0], [0, 0, 1, 1], [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    adv = compute_advantages("reinforce_plus_plus_baseline", batch).advantages
    # r - group mean: [0.5, -0.5, 0, 0] on every token: [0.5, 0.5 | -0.5 | 0, 0 | 0], then whitened
    w = whitened([0.5, 0.5, -0.5, 0.0, 0.0, 0.0])  # mean 1/12, biased variance 0.7083 / 6
    assert torch.allclose(adv, torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], w[4]], [w[5], 0.0]]), atol=1e-5)


def test_gae_by_hand():
    batch = inputs([1.0], [0], [[1.0, 1.0, 1.0]], values=torch.tensor([[0.5, 0.6, 0.8]]))
    result = compute_advantages("ppo", batch, AdvantageOptions(gamma=1.0, lam=0.5))
    # delta = [0 + 0.6 - 0.5, 0 + 0.8 - 0.6, 1 + 0 - 0.8] = [0.1, 0.2, 0.2]
    # A_2 = 0.2, A_1 = 0.2 + 0.5 * 0.2 = 0.3, A_0 = 0.1 + 0.5 * 0.3 = 0.25; returns = A + V
    assert torch.allclose(result.advantages, torch.tensor([[0.25, 0.3, 0.2]]), atol=1e-6)
    assert torch.allclose(result.returns, torch.tensor([[0.75, 0.9, 1.0]]), atol=1e-6)


def test_gae_with_lambda_one_returns_the_discounted_reward():
    # whatever V is, lambda = 1 telescopes to G_t = gamma^(T-1-t) * R: [0.81, 0.9, 1]
    batch = inputs([1.0], [0], [[1.0, 1.0, 1.0, 0.0]], values=torch.tensor([[0.3, -0.2, 0.9, 5.0]]))
    result = compute_advantages("ppo", batch, AdvantageOptions(gamma=0.9, lam=1.0))
    assert torch.allclose(result.returns, torch.tensor([[0.81, 0.9, 1.0, 0.0]]), atol=1e-6)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("ppo", inputs([1.0], [0], [[1.0]]))


def test_whitening_option_applies_to_any_estimator():
    batch = inputs([1.0, 0.0, 0.0], [0, 0, 0], [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    plain = compute_advantages("grpo", batch).advantages
    adv = compute_advantages("grpo", batch, AdvantageOptions(whiten=True)).advantages
    # the five masked tokens of plain: [a, a, b, b, b] with a = 2/3 / std, b = -1/3 / std
    w = whitened([plain[0, 0].item(), plain[0, 1].item(), plain[1, 0].item(), plain[2, 0].item(), plain[2, 1].item()])
    assert torch.allclose(adv, torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]]), atol=1e-5)


def test_masked_whiten_by_hand():
    # [1, 3] on the mask: mean 2, biased variance 1
    assert torch.allclose(masked_whiten(torch.tensor([[1.0, 3.0, 7.0]]), torch.tensor([[1.0, 1.0, 0.0]])),
                          torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6)


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("a2c", inputs([1.0], [0], [[1.0]]))


def test_config_maps_to_options_and_refuses_what_the_trainer_cannot_run():
    cfg = TrainerConfig(advantage_estimator="reinforce_plus_plus", gamma=0.9, whiten_advantages=True)
    assert advantage_options(cfg) == AdvantageOptions(whiten=True, gamma=0.9)
    Config(trainer={"advantage_estimator": "ppo", "kl_coef": 0.1})  # value head and reference: local backend
    with pytest.raises(ValueError, match="value head on trainer.backend=local"):
        Config(trainer={"advantage_estimator": "ppo", "backend": "fsdp2"})
    with pytest.raises(ValueError, match="grpo and gspo have none"):
        Config(trainer={"kl_coef": 0.1})
    with pytest.raises(ValueError, match="reference policy runs on trainer.backend=local"):
        Config(trainer={"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "backend": "megatron"})
