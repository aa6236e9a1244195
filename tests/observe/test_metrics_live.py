"""`milestream metrics --once`: the live view of a job, from its topics alone (the run's config.yaml
names the broker), with reward, staleness, queue, throughput, drops by reason, versions and step time."""
from __future__ import annotations

from metrics_records import publish_run

from milestream import cli


def test_live_view_from_the_topics(cfg, capsys, monkeypatch):
    publish_run(cfg)
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "config.yaml").write_text(cfg.to_yaml())  # what `milestream run` writes
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["metrics", "--once", "--run-dir", str(cfg.run_path)]) == 0
    view = capsys.readouterr().out
    lines = {" ".join(line.split()) for line in view.splitlines()}
    expected = {  # the run's own knobs (3 steps, capacity 4) come from its config.yaml
        "step 4/3 step time 10.0 s loss -0.0400",
        "reward 0.400 last step, 0.250 mean of the last 4",
        "staleness mean 1.50 max 2 (bound 2, async)",
        "throughput 32 trained tokens/s",  # 32 samples x 10 tokens over the 10 s since step 3
        "queue 3 of 4 groups partial 1 credit 3",
        "drops filtered 1 stale 2",  # g1 was dropped (and resent) once
        "rollout 1 workers, 3.20 samples/s",
        "worker-0 samples 96 inflight 8 version 2",
        "weights v2 (disk, 0.0 MB) mismatched 1",
        "engines worker-0 v2 (0.50 s)",
    }
    assert expected - lines == set(), view
