"""The learner's step on the tiny model: PPO trains its value head towards the GAE returns."""
from __future__ import annotations

import torch

from milestream.config import Config
from milestream.train.estimators import AdvantageInputs, AdvantageOptions, ppo_gae
from milestream.train.learner import CollectedGroup, Learner
from milestream.train.logprobs import pad
from milestream.infra.model import configure_process
from milestream.schemas.records import GroupSample


def group(gid: str, prompt: list[int], rewards: list[float]) -> CollectedGroup:
    samples = [GroupSample(f"{gid}/{i}", gid, gid, i, len(rewards), prompt, [5 + i, 6, 7 + i], [1, 1, 1], [0, 0, 0],
                           reward, "completed", "", "e", "w", 0.0, 0.0, logprobs=[-2.0, -2.0, -2.0])
               for i, reward in enumerate(rewards)]
    return CollectedGroup(gid, samples, 0)


def test_ppo_fits_its_value_head_to_the_returns_and_checkpoints_it():
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32"},
                                  trainer={"advantage_estimator": "ppo", "lam": 0.95, "lr": 1e-2})
    configure_process(cfg.model)
    learner = Learner(cfg)
    batch = [group("a", [1, 2, 3], [1.0, 0.0]), group("b", [4, 2], [0.0, 0.5])]
    rows = learner._microbatches(batch)
    samples = [s for r in rows for s in r.samples]
    old = torch.cat([r.old_values for r in rows])
    # the learner's advantages are GAE over the value head's own V before the step
    expected = ppo_gae(AdvantageInputs(torch.tensor([s.reward for s in samples]), torch.tensor([0, 0, 1, 1]),
                                       pad([s.loss_mask for s in samples]), values=old),
                       AdvantageOptions(lam=0.95))
    assert torch.allclose(torch.cat([r.advantages for r in rows]), expected.advantages)
    assert torch.allclose(torch.cat([r.returns for r in rows]), expected.returns)

    value_losses = [learner.train_step(batch)["value_loss"] for _ in range(15)]
    assert value_losses[-1] < 0.5 * value_losses[0]
    assert not any(name.startswith("value_head") for name in learner.export_weights())  # engines never see it

    restored = Learner(cfg)
    restored.load_state_dict(learner.state_dict())
    assert torch.equal(restored.backend.value_head.proj.weight, learner.backend.value_head.proj.weight)


def test_the_kl_penalty_compares_the_sampling_policy_with_the_lora_free_reference():
    cfg = Config().with_overrides(model={"name": "tiny-random", "dtype": "float32"},
                                  trainer={"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "lr": 1e-2})
    configure_process(cfg.model)
    learner = Learner(cfg)
    batch = [group("a", [1, 2, 3], [1.0, 0.0])]
    (rows,) = learner._microbatches(batch)
    reference = learner.backend.reference_logprobs(rows.prompt_ids, [s.response_ids for s in rows.samples], 1.0)
    # LoRA B starts at zero: before any step the reference is the policy itself
    assert torch.allclose(reference, learner.backend.logprobs(rows.prompt_ids, [s.response_ids for s in rows.samples],
                                                              1.0).detach(), atol=1e-6)
    for _ in range(3):
        learner.train_step(batch)
    after = learner.backend.logprobs(rows.prompt_ids, [s.response_ids for s in rows.samples], 1.0).detach()
    unchanged = learner.backend.reference_logprobs(rows.prompt_ids, [s.response_ids for s in rows.samples], 1.0)
    assert torch.equal(unchanged, reference) and not torch.allclose(after, reference)
