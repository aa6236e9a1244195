"""The objective's knobs (trainer.clip_eps_high ... trainer.group_normalize) against figures worked out
by hand on a few tokens, extreme log-ratios, and a non-finite step on the tiny model."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from batches import group, tiny
from torch import nn

from milestream.config import TrainerConfig
from milestream.infra.model import load_model
from milestream.train.backends.base import apply_update
from milestream.train.estimators import AdvantageInputs, AdvantageOptions, advantage_options, compute_advantages
from milestream.train.learner import Learner
from milestream.train.losses import (Denominators, LossInput, PolicyLoss, Regularized, kl_estimate, log_ratio,
                                     make_loss, reduce_loss, step_figures, supervised_loss)
from milestream.train.tensor_ops import token_logprobs_and_entropy

E = math.e
INF, NAN = math.inf, math.nan


def batch(logp, advantages, old=None, rollout=None, mask=None, ref=None, entropy=None) -> LossInput:
    """Rows of tokens; pi_old and pi_rollout default to pi (ratio 1, weight 1)."""
    logp = torch.tensor(logp, requires_grad=True)
    old_logp = torch.tensor(old) if old is not None else logp.detach()
    return LossInput(logp=logp, old_logp=old_logp,
                     rollout_logp=torch.tensor(rollout) if rollout is not None else old_logp,
                     advantages=torch.tensor(advantages), mask=torch.tensor(mask) if mask else torch.ones_like(logp),
                     ref_logp=None if ref is None else torch.tensor(ref),
                     entropy=None if entropy is None else torch.tensor(entropy, requires_grad=True))


def test_clip_eps_high_raises_only_the_upper_bound():
    # log pi - log pi_old = [0.5, 0.2, -0.5]: r = [1.649, 1.221, 0.607]; A = [1, 1, -1]
    ratios = dict(logp=[[-1.0, -1.3, -2.0]], old=[[-1.5, -1.5, -1.5]], advantages=[[1.0, 1.0, -1.0]])
    symmetric = PolicyLoss(clip_eps=0.2, correction="none")(batch(**ratios))
    # -A clip(r, 0.8, 1.2): token 1 -1.2, token 2 -1.2, token 3 max(0.607, 0.8) = 0.8
    assert math.isclose(symmetric.loss_sum.item(), -1.2 - 1.2 + 0.8, rel_tol=1e-6)
    higher = batch(**ratios)
    out = PolicyLoss(clip_eps=0.2, clip_eps_high=0.28, correction="none")(higher)
    # upper bound 1.28: token 1 clipped to -1.28, token 2 unclipped -e^0.2, token 3 still 0.8 (lower bound 0.8)
    assert math.isclose(out.loss_sum.item(), -1.28 - math.exp(0.2) + 0.8, rel_tol=1e-6)
    assert out.figures["ppo_clip_frac"] == 2
    out.loss_sum.backward()
    assert torch.allclose(higher.logp.grad, torch.tensor([[0.0, -math.exp(0.2), 0.0]]), atol=1e-6)


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # log-ratios [2, 0.5, 2], A = [-1, -1, 1], eps 0.2, c = 3
    rows = dict(logp=[[-1.0, -1.0, -1.0]], old=[[-3.0, -1.5, -3.0]], advantages=[[-1.0, -1.0, 1.0]])
    plain = PolicyLoss(correction="none")(batch(**rows))
    # max(-A r, -A clip r): e^2 = 7.389 (unclipped), e^0.5 = 1.649 (unclipped), max(-7.389, -1.2) = -1.2
    assert math.isclose(plain.loss_sum.item(), E ** 2 + math.exp(0.5) - 1.2, rel_tol=1e-6)
    dual = batch(**rows)
    out = PolicyLoss(correction="none", dual_clip_c=3.0)(dual)
    # A < 0: min(that, -c A = 3): 7.389 -> 3 (flat), 1.649 stays; A > 0 untouched
    assert math.isclose(out.loss_sum.item(), 3.0 + math.exp(0.5) - 1.2, rel_tol=1e-6)
    assert out.figures["ppo_dual_clip_frac"] == 1 and out.figures["ppo_clip_frac"] == 1
    out.loss_sum.backward()
    assert torch.allclose(dual.logp.grad, torch.tensor([[0.0, math.exp(0.5), 0.0]]), atol=1e-6)


def test_dual_clip_c_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        TrainerConfig(dual_clip_c=1.0)
    assert make_loss(TrainerConfig(dual_clip_c=3.0, clip_eps_high=0.28)) == PolicyLoss(
        0.2, "tis", (0.0, 2.0), clip_eps_high=0.28, dual_clip_c=3.0)


def test_log_ratio_clamps_after_nan_to_num():
    ratio = log_ratio(torch.tensor([INF, -INF, NAN, 1e4, -1e4, 0.5]), torch.zeros(6), clamp=2.0)
    assert torch.equal(ratio, torch.tensor([2.0, -2.0, 0.0, 2.0, -2.0, 0.5]))
    # the clamp sits before exp in the PPO ratio: log r = 3 clamped to 1, A = -1: the loss is e, not e^3
    out = PolicyLoss(correction="none", log_ratio_clamp=1.0)(batch([[-1.0]], [[-1.0]], old=[[-4.0]]))
    assert math.isclose(out.loss_sum.item(), E, rel_tol=1e-6)
    # and in the correction weight: log w = 3 clamped to 1, TIS interval [0, 5]: w = e
    out = PolicyLoss(correction="tis", interval=(0.0, 5.0), log_ratio_clamp=1.0)(
        batch([[-1.0]], [[1.0]], rollout=[[-4.0]]))
    assert math.isclose(out.loss_sum.item(), -E, rel_tol=1e-6)


EXTREMES = [INF, -INF, NAN, 1e4, -1e4]


def extreme_batch() -> LossInput:
    """Every log-ratio the loss takes (pi/pi_old, pi_old/pi_rollout, pi/pi_ref) meets +-inf, nan, +-1e4,
    and pi itself holds -inf and nan (tokens 6 and 7)."""
    logp = [-1.0] * 5 + [-INF, NAN]
    old = [-1.0 - e for e in EXTREMES] + [-1.0, -1.0]
    rollout = [-1.0 + e for e in reversed(EXTREMES)] + [-INF, NAN]
    ref = [-1.0 + e for e in EXTREMES[1:] + EXTREMES[:1]] + [NAN, INF]
    return batch([logp], [[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0]], old=[old], rollout=[rollout], ref=[ref],
                 entropy=[[0.5] * 7])


@pytest.mark.parametrize("gspo", [False, True])
def test_extreme_log_ratios_give_a_finite_loss_and_finite_gradients(gspo):
    knobs = itertools.product(["tis", "clip_or_pop", "none"], [None, 3.0], [None, 0.1], ["k1", "k2", "k3"])
    for correction, dual_clip_c, opsm_delta, kl_type in knobs:
        inputs = extreme_batch()
        policy = PolicyLoss(correction=correction, sequence_ratio=gspo, dual_clip_c=dual_clip_c, opsm_delta=opsm_delta)
        out = Regularized(policy, kl_coef=0.1, kl_type=kl_type, entropy_coef=0.01)(inputs)
        shares = [reduce_loss(out, inputs.mask, reduction, Denominators(7, 1, 8))
                  for reduction in ("token_mean", "sample_mean", "seq_sum")]
        sum(shares).backward()
        knob = (correction, dual_clip_c, opsm_delta, kl_type)
        assert all(torch.isfinite(share) for share in shares), knob
        assert torch.isfinite(inputs.logp.grad).all() and torch.isfinite(inputs.entropy.grad).all(), knob
        assert all(math.isfinite(v) for v in step_figures(out.figures, 7, 1).values()), (knob, out.figures)


def test_entropy_of_a_distribution_with_a_minus_infinite_logit():
    # p = [0.25, 0.75, 0]: H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623; the -inf logit adds 0, not nan
    logits = torch.tensor([[[0.0, math.log(3.0), -INF]]], requires_grad=True)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]))
    assert math.isclose(entropy.item(), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), rel_tol=1e-6)
    assert math.isclose(logp.item(), math.log(0.75), rel_tol=1e-6)
    (entropy * 1e6).sum().backward()  # a large upstream gradient must not meet 0 * inf either
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0


# two microbatches: sample a (3 tokens, A = 1, losses -1 each) alone, then sample b (1 of 2 tokens, A = -2, loss 2)
TWO_MICROBATCHES = [dict(logp=[[-1.0, -1.0, -1.0]], advantages=[[1.0, 1.0, 1.0]]),
                    dict(logp=[[-1.0, -1.0]], advantages=[[-2.0, -2.0]], mask=[[1.0, 0.0]])]


@pytest.mark.parametrize("reduction, expected", [
    ("token_mean", (-3.0 + 2.0) / 4),  # the batch's 4 tokens
    ("sample_mean", (-3.0 / 3 + 2.0 / 1) / 2),  # each sample's mean, then the mean of the 2 samples
    ("seq_sum", (-3.0 + 2.0) / (2 * 6)),  # 2 samples x the constant 6 (rollout.max_new_tokens)
])
def test_reducers_across_two_microbatches(reduction, expected):
    denominators = Denominators(tokens=4, samples=2, seq_sum_length=6)
    inputs = [batch(**rows) for rows in TWO_MICROBATCHES]
    outs = [PolicyLoss(correction="none")(one) for one in inputs]
    assert [out.row_sums.tolist() for out in outs] == [[-3.0], [2.0]]
    total = sum(reduce_loss(out, one.mask, reduction, denominators) for out, one in zip(outs, inputs))
    assert math.isclose(total.item(), expected, rel_tol=1e-6)


def test_sample_mean_needs_row_sums_and_the_others_do_not():
    out = supervised_loss(batch(**TWO_MICROBATCHES[0]))
    plain = type(out)(out.loss_sum, out.tokens, out.figures)  # a user loss of before: no row_sums
    denominators = Denominators(tokens=3, samples=1, seq_sum_length=4)
    assert reduce_loss(plain, torch.ones(1, 3), "token_mean", denominators).item() == 1.0  # -(-3) / 3
    assert reduce_loss(plain, torch.ones(1, 3), "seq_sum", denominators).item() == 0.75
    with pytest.raises(ValueError, match="row_sums"):
        reduce_loss(plain, torch.ones(1, 3), "sample_mean", denominators)


def test_kl_estimators_by_hand():
    # d = log pi - log pi_ref = [0.5, -0.5]
    for kind, values, grads in [
        ("k1", [0.5, -0.5], [1.0, 1.0]),
        ("k2", [0.125, 0.125], [0.5, -0.5]),  # d^2 / 2, gradient d
        ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5], [1 - math.exp(-0.5), 1 - math.exp(0.5)]),  # e^-d + d - 1
    ]:
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        kl = kl_estimate(logp, torch.tensor([[-1.5, -1.5]]), kind)
        kl.sum().backward()
        assert torch.allclose(kl, torch.tensor([values]), atol=1e-6), kind
        assert torch.allclose(logp.grad, torch.tensor([grads]), atol=1e-6), kind


def test_kl_loss_and_entropy_bonus_add_to_the_policy_loss_per_token():
    # zero advantages: the policy part is 0; k3 on d = [0.5, -0.5] (second token off the mask), H = [2, 7]
    inputs = batch([[-1.0, -2.0]], [[0.0, 0.0]], mask=[[1.0, 0.0]], ref=[[-1.5, -1.5]], entropy=[[2.0, 7.0]])
    loss = make_loss(TrainerConfig(kl_loss_coef=0.1, entropy_coef=0.01, kl_loss_type="k3"))
    out = loss(inputs)
    k3 = math.exp(-0.5) - 0.5
    assert math.isclose(out.loss_sum.item(), 0.1 * k3 - 0.01 * 2.0, rel_tol=1e-6)
    assert math.isclose(out.figures["kl_ref"], k3, rel_tol=1e-6) and out.figures["entropy"] == 2.0
    assert torch.allclose(out.row_sums, out.loss_sum.view(1))
    out.loss_sum.backward()
    assert torch.allclose(inputs.logp.grad, torch.tensor([[0.1 * (1 - math.exp(-0.5)), 0.0]]), atol=1e-6)
    assert torch.allclose(inputs.entropy.grad, torch.tensor([[-0.01, 0.0]]))


def test_kl_loss_and_entropy_are_refused_off_the_local_backend():
    for knob in ("kl_loss_coef", "entropy_coef"):
        with pytest.raises(ValueError, match=f"trainer.{knob} runs on trainer.backend=local only"):
            TrainerConfig(backend="fsdp2", **{knob: 0.1})


def test_opsm_masks_negative_sequences_the_rollout_strayed_on():
    # log pi_rollout - log pi_old: row 1 [0.3, 0.1] (mean 0.2), row 2 the same, row 3 [0.05, 0.05]
    rows = dict(logp=[[-1.0, -1.0]] * 3, advantages=[[-1.0, -1.0], [1.0, 1.0], [-0.5, -0.5]],
                rollout=[[-0.7, -0.9], [-0.7, -0.9], [-0.95, -0.95]])
    inputs = batch(**rows)
    out = PolicyLoss(correction="none", opsm_delta=0.1)(inputs)
    # row 1: A < 0 and 0.2 > 0.1: masked; row 2: A > 0, kept (-2); row 3: 0.05 <= 0.1, kept (+1)
    assert math.isclose(out.loss_sum.item(), -2.0 + 1.0, rel_tol=1e-6) and out.tokens == 6
    assert out.row_sums.tolist() == [0.0, -2.0, 1.0]
    out.loss_sum.backward()
    assert torch.equal(inputs.logp.grad[0], torch.zeros(2))
    figures = step_figures(out.figures, tokens=6.0, samples=3)
    assert math.isclose(figures["opsm_masked_frac"], 1 / 3)  # sequences, not tokens
    unmasked = PolicyLoss(correction="none")(batch(**rows))
    assert math.isclose(unmasked.loss_sum.item(), 2.0 - 2.0 + 1.0, rel_tol=1e-6)


def test_group_normalize_off_trains_on_the_raw_reward():
    inputs = AdvantageInputs(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]),
                             torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    for name in ("grpo", "gspo"):
        raw = compute_advantages(name, inputs, AdvantageOptions(group_normalize=False)).advantages
        assert torch.equal(raw, torch.tensor([[1.0, 1.0], [0.0, 0.0], [3.0, 3.0], [3.0, 3.0]]))
    centred = compute_advantages("grpo", inputs, AdvantageOptions(group_std_normalize=False)).advantages
    assert torch.equal(centred[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert advantage_options(TrainerConfig(group_normalize=False)).group_normalize is False


def test_is_ess_over_the_whole_batch_across_microbatches():
    # log w = log pi_old - log pi_rollout = [0, 1, -1]: w = [1, e, 1/e], split 1 + 2 tokens over two microbatches
    parts = [dict(logp=[[-1.0]], advantages=[[1.0]], rollout=[[-1.0]]),
             dict(logp=[[-1.0, -2.0]], advantages=[[1.0, 1.0]], rollout=[[-2.0, -1.0]])]
    sums: dict[str, float] = {}
    for part in parts:
        for name, value in PolicyLoss()(batch(**part)).figures.items():
            sums[name] = sums.get(name, 0.0) + value
    ess = (1 + E + 1 / E) ** 2 / (3 * (1 + E ** 2 + E ** -2))  # (sum w)^2 / (n sum w^2) = 0.653
    figures = step_figures(sums, tokens=3.0, samples=2)
    assert math.isclose(figures["is_ess"], ess, rel_tol=1e-6) and "is_ess_sum_w" not in figures
    assert math.isclose(step_figures(PolicyLoss()(batch(**parts[0])).figures, 1.0, 1)["is_ess"], 1.0)


def test_apply_update_skips_a_non_finite_gradient_norm():
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    layer(torch.ones(1, 2)).sum().backward()
    result = apply_update(optimizer, {"loss": 1.0, "tokens": 2.0}, INF)
    assert result.update_skipped and result.figures == {"tokens": 2.0}
    assert all(p.grad is None for p in layer.parameters()) and not optimizer.state
    assert all(torch.equal(before[name], t) for name, t in layer.state_dict().items())
    layer(torch.ones(1, 2)).sum().backward()
    assert not apply_update(optimizer, {"loss": 1.0}, 1.0).update_skipped
    assert not torch.equal(before["bias"], layer.bias.detach())


@pytest.mark.parametrize("reduction, expected", [
    ("token_mean", (-3.0 + 2.0 - 1.0 + 0.0) / 8),
    ("sample_mean", (-1.0 + 2.0 - 0.5 + 0.0) / 4),
    ("seq_sum", (-3.0 + 2.0 - 1.0 + 0.0) / (4 * 5)),
])
def test_the_learner_reduces_over_the_whole_batch(reduction, expected):
    """Two prompts (two microbatches), samples of 3, 1, 2 and 2 tokens. Raw rewards as advantages, no
    correction, pi_old = pi: every token's loss is -A. Rows: -3, +2 (group a); -1, 0 (group b)."""
    learner = Learner(tiny(group_normalize=False, correction="none", loss_reduction=reduction, lr=0.0))
    figures = learner.train_step([group("a", [1, 2, 3], [(3, 1.0), (1, -2.0)]),
                                  group("b", [4, 2], [(2, 0.5), (2, 0.0)])])
    assert math.isclose(figures["loss"], expected, rel_tol=1e-6)
    assert figures["update_skipped"] == 0.0 and figures["is_ess"] <= 1.0


def test_the_learner_feeds_the_kl_loss_and_the_entropy_bonus():
    learner = Learner(tiny(kl_loss_coef=0.5, entropy_coef=0.01))
    batch_ = [group("a", [1, 2, 3], [(3, 1.0), (2, 0.0)])]
    first = learner.train_step(batch_)
    assert abs(first["kl_ref"]) < 1e-6  # LoRA B starts at zero: pi is pi_ref before the first step
    # the entropy figure is the mean over the 5 response tokens of H of a plain full forward
    model = load_model(learner.cfg.model, dtype=torch.float32)
    entropies = []
    for sample in batch_[0].samples:
        logits = model(input_ids=torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
        logp = torch.log_softmax(logits[len(sample.prompt_ids) - 1:-1], dim=-1)
        entropies += (-(logp.exp() * logp).sum(-1)).tolist()
    assert math.isclose(first["entropy"], sum(entropies) / len(entropies), rel_tol=1e-4)
    second = learner.train_step(batch_)
    assert second["kl_ref"] > 0.0 and math.isfinite(second["loss"])


def test_a_non_finite_loss_leaves_the_weights_unchanged():
    learner = Learner(tiny())
    before = {name: t.detach().clone() for name, t in learner.export_weights().items()}
    poisoned = [group("a", [1, 2, 3], [(3, NAN), (2, 0.0)])]  # a reward function that returned nan
    figures = learner.train_step(poisoned)
    assert figures["update_skipped"] == 1.0 and not math.isfinite(figures["loss"])
    after = learner.export_weights()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not learner.backend.optimizer.state  # Adam's moments untouched too
    assert all(p.grad is None for p in learner.backend.params.values())
    healthy = learner.train_step([group("a", [1, 2, 3], [(3, 1.0), (2, 0.0)])])
    assert healthy["update_skipped"] == 0.0
    assert any(not torch.equal(before[name], t) for name, t in learner.export_weights().items())
