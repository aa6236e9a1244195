"""Your own model, data and reward, end to end: ``milestream run`` on a model folder (not a built-in name), a
JSONL data set and a reward given by import path, then ``milestream export`` of the final version, reloaded
by plain transformers with the trainer's own logits at that version (fp32, full fine-tuning: exact).

The reward raises for the prompts of odd rows: their groups must leave on ``buffer.dropped`` with reason
``reward_error`` (never a silent zero), the run must still finish, and the audit must find nothing lost,
trained twice or held on to."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_folders import tiny_llama_folder
from stage_runs import run_showing_logs
from transformers import AutoModelForCausalLM

from milestream.cli import main
from milestream.log.audit import archived_lineage, audit_run
from milestream.train import checkpoint
from milestream.train.learner import Learner

PLUGINS = str(Path(__file__).parent / "plugins")
PROBE = torch.tensor([[1, 17, 230, 4051, 9, 77, 12, 500, 3, 44]])


def write_jsonl(path: Path, rows: int) -> Path:
    lines = [{"question": f"What is {r} plus {r + 1}?", "answer": str(2 * r + 1), "row": r} for r in range(rows)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture
def own_cfg(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PLUGINS)  # the stages import the reward from here
    monkeypatch.syspath_prepend(PLUGINS)  # and so does the check before they start
    folder = tiny_llama_folder(tmp_path / "my-model")
    data = write_jsonl(tmp_path / "train.jsonl", rows=24)
    return cfg.with_overrides(
        model={"path": str(folder), "name": "tiny-random", "lora_rank": 0, "dtype": "float32"},
        data={"path": str(data), "prompt_key": "question", "label_key": "answer", "metadata_keys": ["row"]},
        reward={"fn": "reward_hooks:fails_on_odd_rows"},
        trainer={"steps": 3, "checkpoint_every": 1, "lr": 1e-3}, run={"max_wall_s": 240})


def trainer_logits_at_last_checkpoint(cfg) -> tuple[int, torch.Tensor]:
    """The trainer's own model at its newest checkpoint, through milestream's learner (not the export)."""
    payload = checkpoint.load_latest(cfg.run.run_dir)
    learner = Learner(cfg)
    learner.load_state_dict(payload["backend"])
    with torch.no_grad():
        return checkpoint.restore(payload).step, learner.backend.model(PROBE).logits


def test_your_model_data_and_reward_train_and_export(own_cfg, tmp_path):
    cfg = own_cfg
    summary = run_showing_logs(cfg)
    assert summary["steps"] == cfg.trainer.steps and summary["stopped_by"] == "steps"
    assert summary["buffer"]["unaccounted"] == 0, summary["buffer"]  # no credit leaked by the failing rewards

    audit = audit_run(cfg.run.run_dir)
    assert audit.exact, audit
    drops = archived_lineage(cfg.run.run_dir).drops
    reward_errors = {gid for gid, d in drops.items() if d.reason == "reward_error"}
    assert reward_errors, "the odd rows' groups must be dropped for their reward error"
    assert all("no reward for row" in drops[gid].detail for gid in reward_errors)
    trained_rows = {int(gid.split("#")[0].rsplit("-", 1)[1]) for gid in archived_lineage(cfg.run.run_dir).training()}
    assert trained_rows and all(row % 2 == 0 for row in trained_rows)

    out = tmp_path / "exported"
    assert main(["export", "--run-dir", cfg.run.run_dir, "--out", str(out)]) == 0
    facts = json.loads((out / "milestream.json").read_text())
    step, trainer_logits = trainer_logits_at_last_checkpoint(cfg)
    assert facts["version"] == step == cfg.trainer.steps
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    with torch.no_grad():
        assert torch.equal(exported(PROBE).logits, trainer_logits)
