"""On-policy distillation in the learner (train/distill.py): the teacher's reverse KL as the advantage, mixed
with the task's, or as a reward the estimator sees; its figures; a teacher that agrees moves nothing."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from batches import group, tiny

from milestream.train.estimators import AdvantageInputs, AdvantageOptions, compute_advantages
from milestream.train.learner import CollectedGroup, Learner

# rollout log-prob -2 on every token (batches.group); the teacher's per sample, per token
TEACHER = [[-1.0, -2.5, -2.0], [-3.0, -2.0, -0.5]]
D = [[-1.0, 0.5, 0.0], [1.0, 0.0, -1.5]]  # log pi_rollout - log pi_teacher


def taught(batch: CollectedGroup, teacher: list[list[float]]) -> CollectedGroup:
    return replace(batch, samples=[replace(s, teacher_logprobs=t) for s, t in zip(batch.samples, teacher)])


def distilling(**distill):
    # the learner never calls the teacher: teacher_url only switches distillation on
    return tiny(advantage_estimator="grpo").with_overrides(distill={"teacher_url": "http://teacher", **distill})


def advantages(learner: Learner, batch: list[CollectedGroup]) -> torch.Tensor:
    return torch.cat([rows.advantages for rows in learner._microbatches(batch)])


def test_advantage_mode_mixes_the_task_advantage_with_the_teachers_reverse_kl():
    batch = [taught(group("a", [1, 2, 3], [(3, 1.0), (3, 0.0)]), TEACHER)]
    learner = Learner(distilling(task_weight=0.5, coef=2.0))
    task = compute_advantages("grpo", AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                                      torch.ones(2, 3))).advantages
    assert torch.allclose(advantages(learner, batch), 0.5 * task - 2.0 * torch.tensor(D))
    alone = Learner(distilling())  # task_weight 0: the teacher's signal alone
    assert torch.equal(advantages(alone, batch), -torch.tensor(D))


def test_reward_mode_feeds_the_reverse_kl_to_the_estimator():
    batch = [taught(group("a", [1, 2, 3], [(3, 1.0), (3, 0.0)]), TEACHER)]
    # grpo: each sample's reward is task_weight r - coef sum_t d_t, then normalised over the group
    learner = Learner(distilling(mode="reward", task_weight=1.0, coef=0.5))
    rewards = torch.tensor([1.0 - 0.5 * sum(D[0]), 0.0 - 0.5 * sum(D[1])])
    expected = compute_advantages("grpo", AdvantageInputs(rewards, torch.tensor([0, 0]), torch.ones(2, 3)))
    assert torch.allclose(advantages(learner, batch), expected.advantages)
    # reinforce_plus_plus: -coef d_t is each token's reward, the task reward on the last token
    cfg = distilling(mode="reward", coef=0.5).with_overrides(trainer={"advantage_estimator": "reinforce_plus_plus"})
    token_level = compute_advantages("reinforce_plus_plus", AdvantageInputs(
        torch.zeros(2), torch.tensor([0, 0]), torch.ones(2, 3), token_rewards=-0.5 * torch.tensor(D)),
        AdvantageOptions())
    assert torch.allclose(advantages(Learner(cfg), batch), token_level.advantages)


def test_the_steps_figures_measure_the_reverse_kl_on_the_trained_tokens():
    batch = [taught(group("a", [1, 2, 3], [(3, 1.0), (3, 0.0)]), TEACHER)]
    figures = Learner(distilling()).train_step(batch)
    d = [x for row in D for x in row]
    assert math.isclose(figures["distill_kl"], sum(d) / 6, rel_tol=1e-6)
    assert math.isclose(figures["distill_kl_k3"], sum(math.exp(-x) - 1 + x for x in d) / 6, rel_tol=1e-6)
    assert math.isclose(figures["distill_logprob_diff"], sum(abs(x) for x in d) / 6, rel_tol=1e-6)


def test_a_teacher_that_agrees_on_every_token_gives_zero_advantage_and_moves_nothing():
    plain = group("a", [1, 2, 3], [(3, 1.0), (2, 0.0)])
    batch = [taught(plain, [s.logprobs for s in plain.samples])]
    learner = Learner(distilling())
    before = {name: t.clone() for name, t in learner.export_weights().items()}
    assert not advantages(learner, batch).any()
    figures = learner.train_step(batch)
    assert (figures["distill_kl"], figures["distill_logprob_diff"], figures["grad_norm"]) == (0.0, 0.0, 0.0)
    assert all(torch.equal(before[name], t) for name, t in learner.export_weights().items())


def test_a_token_the_teacher_finds_impossible_gives_a_finite_signal():
    batch = [taught(group("a", [1, 2, 3], [(2, 1.0), (2, 0.0)]), [[-math.inf, -2.0], [-2.0, math.nan]])]
    learner = Learner(distilling())
    adv = advantages(learner, batch)
    assert adv[0, 0] == -learner.cfg.trainer.log_ratio_clamp and torch.isfinite(adv).all()
    assert math.isfinite(learner.train_step(batch)["loss"])
