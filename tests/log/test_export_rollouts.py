"""``milestream export-rollouts``: a run's logged samples as Parquet that ``datasets`` and DuckDB read as it is."""
from __future__ import annotations

import math
from pathlib import Path

import datasets
import duckdb
from stage_runs import run_showing_logs

from milestream.cli import main
from milestream.log.audit import archived_lineage
from milestream.log.reader import ArchiveSource
from milestream.log.samples import logged_samples
from milestream.observe.rollouts_export import FILE

PLUGINS = str(Path(__file__).parents[1] / "plugins")


def test_exported_rollouts_load_in_datasets_and_duckdb(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", PLUGINS)  # rewards that differ between samples: --min-reward picks some
    monkeypatch.syspath_prepend(PLUGINS)
    cfg = cfg.with_overrides(reward={"fn": "reward_hooks:length_penalty"})
    assert run_showing_logs(cfg)["steps"] == cfg.trainer.steps
    run = str(cfg.run_path)
    trained = {g for r in archived_lineage(run).trainer_steps() if r.step <= 2 for g in r.group_ids}

    out = tmp_path / "steps"
    assert main(["export-rollouts", "--run-dir", run, "--out", str(out), "--steps", "1:2"]) == 0
    path = str(out / FILE)
    rows = datasets.load_dataset("parquet", data_files=path, split="train", cache_dir=str(tmp_path / "hf"))
    assert set(rows["group_id"]) == trained and len(rows) == len(trained) * cfg.rollout.group_size
    logged = logged_samples(ArchiveSource(run), trained)
    for row in rows:
        sample = logged[row["group_id"]][row["sample_index"]]
        assert row["response_ids"] == sample.response_ids and row["prompt_ids"] == sample.prompt_ids
        assert row["token_versions"] == sample.token_versions
        assert math.isclose(row["reward"], sample.reward, rel_tol=1e-6)
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(row["logprobs"], sample.logprobs))
        assert row["response_text"] and row["prompt_text"] and row["outcome"] == "trained"

    [(count, groups, first, last)] = duckdb.sql(
        f"select count(*), count(distinct group_id), min(step), max(step) from read_parquet('{path}')").fetchall()
    assert (count, groups) == (len(rows), len(trained)) and 1 <= first <= last <= 2

    best = max(rows["reward"])
    top = tmp_path / "best"
    assert main(["export-rollouts", "--run-dir", run, "--out", str(top), "--min-reward", str(best)]) == 0
    rewards = [r for (r,) in duckdb.sql(f"select reward from read_parquet('{top / FILE}')").fetchall()]
    assert rewards and min(rewards) >= best
