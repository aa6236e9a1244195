"""The ``distill`` section of the one typed Config (``Config.distill``): on-policy distillation (OPD).

A teacher scores every token the student sampled (``milestream teacher``: producers/teacher.py, on the topic
``rollout.teacher_logprobs``); the trainer turns the per-token reverse KL estimate
d_t = log pi_rollout(y_t) - log pi_teacher(y_t) into its signal (train/distill.py). Its own module so that
config.py does not grow past reading; it imports nothing of milestream, config.py imports it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DistillConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # the teacher, at most one of the two (neither: distillation is off): a local Hugging Face folder of a
    # causal LM with the student's vocabulary, which the teacher stage scores with a CpuEngine of its own in
    # the run's dtype and rollout.true_on_policy numerics; or an engine behind SGLang's HTTP API serving the
    # teacher (`milestream engine --set model.path=TEACHER`, or SGLang), asked for prompt log-probs
    teacher_path: str | None = None
    teacher_url: str | None = None
    # advantage: A_t = task_weight * A_task_t - coef * d_t, A_task the trainer.advantage_estimator's
    # reward: -coef * d_t is a reward the estimator sees next to task_weight * the task reward: per token
    #   for the token-level estimators (reinforce_plus_plus, reinforce_plus_plus_baseline, ppo), summed over
    #   the response for grpo and gspo (the sequence's log pi_rollout(y) - log pi_teacher(y))
    mode: Literal["advantage", "reward"] = "advantage"
    coef: float = Field(1.0, gt=0)
    task_weight: float = Field(0.0, ge=0)  # 0: distillation alone; the task reward still shows in reward_mean
    batch_samples: int = Field(32, ge=1)  # trajectories the teacher stage scores together
    timeout_s: float = Field(600.0, gt=0)  # teacher_url: one scoring request

    @field_validator("teacher_path")
    @classmethod
    def _absolute(cls, path: str | None) -> str | None:
        return str(Path(path).expanduser().absolute()) if path else None

    @model_validator(mode="after")
    def _one_teacher(self) -> "DistillConfig":
        if self.teacher_path and self.teacher_url:
            raise ValueError("distill: choose one of teacher_path and teacher_url")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.teacher_path or self.teacher_url)
