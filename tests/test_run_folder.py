"""A run folder: a worker started by hand joins a running `milestream run` with the credentials the run keeps
there (RUN_DIR/credentials.json, created with mode 0600, gone when the run ends); a run started on a folder
that holds another run (another model, data, ...) is refused before anything starts, while the knobs that
may change on resume (RESUME_MAY_CHANGE) may."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from stage_runs import print_logs_unless_done, start_run, wait_for

from milestream import cli
from milestream.config import Config, load_config
from milestream.infra.secret_env import CREDENTIALS_FILE, joining
from milestream.orchestrator import RESUME_MAY_CHANGE, RunFolderConflict, check_run_folder, resume_conflicts, run_loop


def hand_started_worker(run_dir: Path, log: Path) -> subprocess.Popen:
    """`milestream rollout --run-dir RUN`, with no secret in its environment."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MILESTREAM__")}
    return subprocess.Popen([sys.executable, "-m", "milestream.cli", "rollout", "--worker-id", "worker-by-hand",
                             "--run-dir", str(run_dir)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def test_a_worker_started_by_hand_joins_a_run_with_the_credentials_in_its_folder(cfg, tmp_path):
    """The run has no rollout worker of its own: it trains its steps only if the worker started by hand
    reaches the run's embedded Redis, whose password exists nowhere but in the stages' environment and the
    credentials file."""
    cfg = cfg.with_overrides(redis={"url": None}, rollout={"num_workers": 0}, trainer={"steps": 2},
                             run={"max_wall_s": 600})
    run_dir = cfg.run_path
    credentials = run_dir / CREDENTIALS_FILE
    runner, outcome = start_run(cfg)
    worker = None
    try:
        wait_for(credentials.exists, 300, "the run's credentials file", runner)
        assert stat.S_IMODE(credentials.stat().st_mode) == 0o600
        saved = load_config(run_dir / "config.yaml")
        assert saved.redis.url and saved.redis.password is None  # config.yaml holds no secret
        kept = json.loads(credentials.read_text())["redis"]
        assert kept["url"] == saved.redis.url and joining(saved).redis.password.get_secret_value() == kept["password"]
        assert joining(saved.with_overrides(redis={"url": "redis://127.0.0.1:1/0"})).redis.password is None
        worker = hand_started_worker(run_dir, tmp_path / "worker.log")
        runner.join(600)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(60)
        print_logs_unless_done(run_dir, outcome)
        print("==== worker.log", (tmp_path / "worker.log").read_text()[-4000:], sep="\n")
    assert outcome.get("summary", {}).get("steps") == cfg.trainer.steps, outcome
    assert not credentials.exists()  # its Redis is gone with the run: so is its password

    # started again on its folder, the run resumes: what may change on resume may, the model may not
    check_run_folder(cfg.with_overrides(trainer={"steps": 4}, run={"max_wall_s": 60}, rollout={"num_workers": 2},
                                        observe={"tensorboard": True}))
    with pytest.raises(RunFolderConflict, match="model.name: tiny-random there, tiny-moe here"):
        check_run_folder(cfg.with_overrides(model={"name": "tiny-moe"}))


def test_a_run_folder_holding_another_run_is_refused_before_anything_starts(cfg, capsys):
    run_dir = cfg.run_path
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    other = cfg.with_overrides(model={"name": "tiny-moe"}, data={"size": 50}, trainer={"steps": 9})
    with pytest.raises(RunFolderConflict) as refused:
        run_loop(other)
    message = str(refused.value)
    assert "data.size: 100000 there, 50 here; model.name: tiny-random there, tiny-moe here." in message
    assert "trainer.steps" not in message and "Give another --run-dir" in message
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml"]  # nothing started, nothing written

    assert cli.main(["run", "--config", str(run_dir / "config.yaml"), "--set", "reward.verifier=exact_match"]) == 2
    assert "reward.verifier: null there, exact_match here" in capsys.readouterr().err
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml"]


def test_what_may_change_on_resume_names_knobs_and_only_those_may_change(cfg):
    sections = Config.model_fields
    for name in RESUME_MAY_CHANGE:
        section, _, knob = name.partition(".")
        assert section in sections and (not knob or knob in sections[section].annotation.model_fields), name
    saved = yaml.safe_load(cfg.to_yaml())
    resumed = cfg.with_overrides(trainer={"steps": 100, "checkpoint_every": 7}, run={"max_wall_s": 1.0},
                                 broker={"bootstrap_servers": "elsewhere:9092"}, redis={"url": None},
                                 rollout={"num_workers": 5}, eval={"every_versions": 3},
                                 observe={"wandb": "offline", "mlflow_uri": "local"}, model={"threads": 4})
    assert resume_conflicts(saved, resumed) == {}
    changed = cfg.with_overrides(trainer={"objective": "supervised", "lr": 1e-3}, rollout={"group_size": 2},
                                 run={"schedule": "sync"})
    assert set(resume_conflicts(saved, changed)) == {"trainer.objective", "trainer.lr", "rollout.group_size",
                                                      "run.schedule"}
