"""``milestream fork``: a run trained again from its step N on its logged groups. With no knob changed its steps
repeat the original's bit for bit; with another learning rate they differ; either way nothing is generated."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from stage_runs import end_offsets, run_showing_logs

from milestream.cli import main
from milestream.config import Config, load_config
from milestream.log.archive import read_topic
from milestream.log.audit import archived_lineage
from milestream.log.reader import read_archive
from milestream.observe.fork import ForkError, fork_batches, fork_run, refused_knobs
from milestream.schemas import topics
from milestream.schemas.records import Metrics

PLUGINS = str(Path(__file__).parents[1] / "plugins")
ROLLOUT_TOPICS = [spec for spec in topics.CATALOGUE if spec.name.startswith("rollout.")]


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


def steps_of(run_dir: Path) -> dict[int, Metrics]:
    return archived_lineage(run_dir).steps


def checksums_of(run_dir: Path) -> dict[int, list[str]]:
    return {v.version: v.checksums for m in read_archive(run_dir, topics.WEIGHT_VERSIONS) for v in m.records}


def test_a_fork_repeats_the_original_bit_for_bit_and_another_learning_rate_differs(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PLUGINS)  # a reward that tells samples apart: advantages, so updates
    monkeypatch.syspath_prepend(PLUGINS)  # the check before the stages start imports it too
    cfg = cfg.with_overrides(trainer={"steps": 8, "checkpoint_every": 3, "keep_checkpoints": 5},
                             reward={"fn": "reward_hooks:length_penalty"}, run={"max_wall_s": 300})
    assert run_showing_logs(cfg)["steps"] == 8
    origin = cfg.run_path
    original = load_config(origin / "config.yaml")
    before = end_offsets(cfg, ROLLOUT_TOPICS)

    same = tmp_path / "same"
    fork_run(original, load_config(origin / "config.yaml", [f"run.run_dir={same}"]), origin, 4)
    theirs, ours = steps_of(origin), steps_of(same)
    assert sorted(ours) == [5, 6, 7, 8]
    for step in ours:  # from the checkpoint of step 3, step 4 retrained, then steps 5-8
        assert ours[step].group_ids == theirs[step].group_ids
        assert ours[step].group_staleness == theirs[step].group_staleness
        for name in ("loss", "grad_norm"):
            assert bits(ours[step].values[name]) == bits(theirs[step].values[name]), (step, name)
        assert checksums_of(same)[step] == checksums_of(origin)[step]
    facts = json.loads((same / "fork.json").read_text())
    assert (facts["step"], facts["steps"], facts["started_from_checkpoint"], facts["changed"]) == (4, 4, 3, {})
    assert facts["steps_equal_to_original"] == 4
    assert json.loads((same / "summary.json").read_text())["steps"] == 4
    assert (same / "plots" / "reward.png").stat().st_size > 0

    faster = tmp_path / "faster"
    lr = cfg.trainer.lr * 10
    assert main(["fork", "--from", str(origin), "--step", "4", "--run-dir", str(faster), "--set", f"trainer.lr={lr}",
                 "--set", "eval.mode=shared", "--set", "eval.every_versions=2", "--set", "eval.num_prompts=4",
                 "--steps", "3"]) == 0
    changed = steps_of(faster)
    assert sorted(changed) == [5, 6, 7]
    # step 5 starts from the same state; its update, at another rate, leaves other weights, and the losses part
    assert bits(changed[5].values["loss"]) == bits(theirs[5].values["loss"])
    assert checksums_of(faster)[7] != checksums_of(origin)[7]
    assert any(bits(changed[s].values["loss"]) != bits(theirs[s].values["loss"]) for s in (6, 7))
    faster_facts = json.loads((faster / "fork.json").read_text())
    assert faster_facts["changed"] == {"trainer.lr": [cfg.trainer.lr, lr], "eval.mode": [None, "shared"],
                                       "eval.every_versions": [10, 2], "eval.num_prompts": [32, 4]}
    assert faster_facts["steps_equal_to_original"] < 3  # step 5's loss is the original's; 6 or 7 differs
    assert 0 <= changed[7].values["fork_foreign_token_frac"] <= 1
    # its due versions (6, and 7: the last) evaluated on the held-out prompts by an engine of its own
    evals = [r for m in read_archive(faster, topics.EVAL_RESULTS) for r in m.records]
    assert [(r.version, r.status) for r in evals] == [(6, "ok"), (7, "ok")]
    assert json.loads((faster / "summary.json").read_text())["heldout_last"]["version"] == 7

    # nothing was generated: the run's rollout topics hold what they held, and no fork logged any rollout record
    assert end_offsets(cfg, ROLLOUT_TOPICS) == before
    for fork in (same, faster):
        assert all(read_topic(fork, spec.name, ["offset"]).num_rows == 0 for spec in ROLLOUT_TOPICS)


def test_knobs_that_would_need_new_generation_are_refused_by_name():
    original = Config()
    fork = original.with_overrides(rollout={"temperature": 0.7}, data={"seed": 1}, trainer={"lr": 1e-3},
                                   run={"schedule": "sync"})
    refused = refused_knobs(original, fork)
    assert set(refused) == {"rollout.temperature", "data.seed", "run.schedule"}
    assert "generated" in refused["rollout.temperature"]
    assert set(refused_knobs(original, original.with_overrides(trainer={"advantage_estimator": "ppo"}))) == {
        "trainer.advantage_estimator"}


def test_a_refused_knob_fails_the_command_naming_it(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "archive").mkdir(parents=True)
    (run / "archive" / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text(Config().to_yaml())
    assert main(["fork", "--from", str(run), "--step", "1", "--run-dir", str(tmp_path / "fork"),
                 "--set", "rollout.group_size=4"]) == 2
    assert "rollout.group_size" in capsys.readouterr().err


@pytest.mark.parametrize("batch_groups, expected", [(2, [["a", "b"], ["c", "d"]]), (3, [["a", "b", "c"]])])
def test_a_fork_cuts_the_logged_groups_into_its_own_batches(batch_groups, expected):
    steps = {s: Metrics("trainer", s, 0.0, {}, ids, [0] * len(ids))
             for s, ids in {1: ["x", "y"], 2: ["a", "b"], 3: ["c", "d"]}.items()}
    assert fork_batches(steps, 1, batch_groups, None) == expected
    with pytest.raises(ForkError, match="--steps 3"):
        fork_batches(steps, 1, 2, 3)
