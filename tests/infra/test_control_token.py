"""The run's control token (issue 31): given as run.control_token it travels in the stages' environment and
never in config.yaml; else the first process that needs one makes RUN_DIR/control.token (mode 0600), and
every other process of the folder reads the same token."""
from __future__ import annotations

import json
import multiprocessing
import stat
from pathlib import Path

from milestream.config import Config, load_config
from milestream.infra.secret_env import CONTROL_TOKEN_FILE, control_token, secret_environment


def _token_of(run_dir: str) -> str:
    return control_token(Config().with_overrides(run={"run_dir": run_dir})).value


def test_a_folder_without_a_token_gets_one_that_every_process_shares(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:  # made at once: the first link wins, all read it
        tokens = set(pool.map(_token_of, [str(tmp_path)] * 8))
    path = tmp_path / CONTROL_TOKEN_FILE
    assert tokens == {path.read_text().strip()} and len(tokens.pop()) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONTROL_TOKEN_FILE]  # no staged file left behind
    assert control_token(Config().with_overrides(run={"run_dir": str(tmp_path)})).source == str(path.resolve())


def test_a_given_token_travels_in_the_environment_and_never_in_the_config_file(tmp_path: Path) -> None:
    cfg = Config().with_overrides(run={"run_dir": str(tmp_path), "control_token": "given-token"})
    assert "given-token" not in cfg.to_yaml()
    config_path = tmp_path / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    stage = load_config(config_path, environ=secret_environment(cfg))  # what a stage reads
    assert control_token(stage).value == "given-token" and control_token(stage).source == "run.control_token"
    assert json.loads(secret_environment(cfg)["MILESTREAM__RUN__CONTROL_TOKEN"]) == "given-token"
    assert not (tmp_path / CONTROL_TOKEN_FILE).exists()
