"""SFT: the trainer's learner with the supervised loss on a data set, no rollout and no broker."""
from __future__ import annotations

import json

import pytest

from milestream.config import Config
from milestream.train import checkpoint
from milestream.train.sft import examples, run_sft


def sft_config(tmp_path, data_path, steps: int) -> Config:
    return Config().with_overrides(
        model={"name": "tiny-random", "dtype": "float32", "lora_rank": 0},
        data={"sft_path": str(data_path)},
        rollout={"group_size": 2},
        trainer={"batch_groups": 2, "steps": steps, "lr": 1e-2, "checkpoint_every": 4},
        run={"run_dir": str(tmp_path / "run")},
    )


def test_sft_learns_the_answers_and_resumes_from_its_checkpoint(tmp_path):
    data = tmp_path / "examples.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(4)))
    history = run_sft(sft_config(tmp_path, data, steps=8))
    nll = [h["nll_mean"] for h in history]
    assert len(nll) == 8 and nll[-1] < 0.6 * nll[0]  # the same 4 examples, seen twice per step
    assert checkpoint.latest_step(tmp_path / "run") == 8

    resumed = run_sft(sft_config(tmp_path, data, steps=10))  # carries on from step 8
    assert [h["step"] for h in resumed] == [9, 10]
    assert resumed[-1]["nll_mean"] < nll[0]


def test_a_bad_data_line_is_named(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"question": "ok?", "answer": 1}) + "\n" + json.dumps({"answer": 2}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        examples(sft_config(tmp_path, data, steps=1))
