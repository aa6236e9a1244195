"""A short loop with TensorBoard, W&B (offline) and MLflow on: the tracker stage SIGKILLed mid-run where it has
written points but not saved its position (a hold point; the trainer held meanwhile, so the run cannot end
first), restarted by the run's supervision. Each store, read with its own reader, holds every trainer step
once with the figures of its record on buffer.metrics, and the held-out evaluations once; the archived run
written again to TensorBoard by ``milestream track --from-archive`` gives the same rows."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from milestream_testkit.chaos import sigkill, stage_pids
from holds import Holds
from stage_runs import print_logs_unless_done, running, start_run, wait_for
from tracker_stores import every_store, tensorboard_points

from milestream.log.reader import read_archive
from milestream.observe.track import run_identity
from milestream.schemas import topics


def logged(run_dir: Path, spec) -> list:
    return [record for message in read_archive(run_dir, spec) for record in message.records]


def test_trackers_killed_mid_run_write_every_step_once_with_the_published_figures(cfg, tmp_path, monkeypatch):
    cfg = cfg.with_overrides(trainer={"steps": 3, "checkpoint_every": 3}, run={"max_wall_s": 240},
                             eval={"mode": "shared", "num_prompts": 4},
                             observe={"tensorboard": True, "wandb": "offline", "mlflow_uri": "local", "commit_s": 0.5})
    run_dir = Path(cfg.run.run_dir)
    holds = Holds.enable(monkeypatch, tmp_path)
    holds.arm("tracker.committing")  # its first commit of written points
    holds.arm("trainer.collected", at_pass=3)
    runner, outcome = start_run(cfg)
    try:
        killed = holds.wait_held("tracker.committing", 240, running(runner, "the tracker to commit points"))
        sigkill(killed)
        holds.release("tracker.committing", killed)
        wait_for(lambda: [p for p in stage_pids(run_dir / "config.yaml", "track") if p != killed], 120,
                 "the tracker started again", runner)
        trainer = holds.wait_held("trainer.collected", 240, running(runner, "the trainer held mid-run"))
        holds.release("trainer.collected", trainer)
        runner.join(300)
    finally:
        print_logs_unless_done(run_dir, outcome)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["summary"]["steps"] == cfg.trainer.steps
    assert (run_dir / "logs" / "tracker.log").read_text().count("==== life") == 2

    published = {m.step: m.values for m in logged(run_dir, topics.METRICS) if m.source == "trainer"}
    evals = {r.step: r.score for r in logged(run_dir, topics.EVAL_RESULTS) if r.status == "ok"}
    assert sorted(published) == list(range(1, cfg.trainer.steps + 1)) and set(evals) == {0, cfg.trainer.steps}
    for store, points in every_store(cfg).items():
        for step, values in published.items():
            assert {k: points[f"trainer/{k}"].get(step) for k in values} == {k: [v] for k, v in values.items()}, store
        for key in (k for k in points if k.startswith("trainer/")):
            assert all(len(v) == 1 for v in points[key].values()), (store, key, points[key])
        assert dict(points["eval/heldout"]) == {step: [score] for step, score in evals.items()}, store

    again = tmp_path / "tb-from-archive"
    subprocess.run([sys.executable, "-m", "milestream.cli", "track", "--tensorboard", str(again),
                    "--from-archive", str(run_dir)], check=True, capture_output=True, timeout=300)
    name = run_identity(cfg)[0]
    live, archived = tensorboard_points(run_dir / "tensorboard" / name), tensorboard_points(again / name)
    trainer_keys = {k for k in live if k.startswith("trainer/") or k.startswith("eval/")}
    assert {k: dict(archived[k]) for k in trainer_keys} == {k: dict(live[k]) for k in trainer_keys}
