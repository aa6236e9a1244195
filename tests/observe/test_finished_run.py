"""Commands that read a run's live topics, on a run that is over (its config.yaml names a broker that is gone):
`milestream metrics` shows its last figures from its archive, `metrics --serve` says the run is over and what
reads it, `topics list` lists the archive's topics with their messages, examples/tail_topic.py tails the
archive; none starts a broker, hangs, or lets librdkafka log a refused connection."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from metrics_records import METRICS_RECORDS, publish_run

from milestream import cli
from milestream.infra.services import EmbeddedBroker, free_port
from milestream.log.archive import Archiver

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tail_topic.py"
LIBRDKAFKA_LOG = ("%3|", "Connection refused")


@pytest.fixture
def no_broker_started(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a command started a broker to read a run")

    monkeypatch.setattr(EmbeddedBroker, "start", refuse)


@pytest.fixture
def finished_run(cfg) -> Path:
    """A run's records archived, and its config.yaml naming a broker nobody listens on any more."""
    publish_run(cfg)
    stop = threading.Event()
    stop.set()  # no live phase: archive what the topics hold, flush, stop
    Archiver(cfg, idle_s=1.0).run(stop)
    gone = cfg.with_overrides(broker={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    (cfg.run_path / "config.yaml").write_text(gone.to_yaml())
    return cfg.run_path


def over_line(run_dir: Path) -> str:
    return f"the run in {run_dir} is over; reading its archive {run_dir / 'archive'}"


def test_metrics_of_a_finished_run_show_its_archive(finished_run, capfd, monkeypatch, no_broker_started):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["metrics", "--run-dir", str(finished_run)]) == 0  # the live view: one snapshot, and done
    out, err = capfd.readouterr()
    assert over_line(finished_run) in " ".join(out.split())
    lines = {" ".join(line.split()) for line in out.splitlines()}
    assert {"reward 0.400 last step, 0.250 mean of the last 4", "drops filtered 1 stale 2",
            "weights v2 (disk, 0.0 MB) mismatched 1"} <= lines, out
    assert not any(text in out + err for text in LIBRDKAFKA_LOG), err

    assert cli.main(["metrics", "--serve", "--prometheus-port", "0", "--run-dir", str(finished_run)]) == 2
    out, err = capfd.readouterr()
    assert "is over" in err and f"`milestream metrics --run-dir {finished_run}` prints its last figures" in err
    assert not any(text in out + err for text in LIBRDKAFKA_LOG), err


def test_topics_list_of_a_finished_run_lists_its_archive(cfg, finished_run, capfd, no_broker_started):
    assert cli.main(["topics", "list", "--run-dir", str(finished_run)]) == 0
    out, err = capfd.readouterr()
    assert over_line(finished_run) in out
    listed = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    prefix = cfg.broker.topic_prefix
    assert listed[f"{prefix}buffer.metrics"] == ["1", "partitions", str(METRICS_RECORDS + 1), "messages"]  # + the bad one
    assert listed[f"{prefix}buffer.dropped"][2:] == ["4", "messages"]
    assert listed[f"{prefix}prompts"] == [str(cfg.broker.partitions), "partitions", "0", "messages"]
    assert not any(text in out + err for text in LIBRDKAFKA_LOG), err


def test_topics_list_of_a_live_run_names_its_broker_and_of_no_run_says_so(cfg, tmp_path, capfd, no_broker_started):
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "config.yaml").write_text(cfg.to_yaml())  # the test broker: live
    assert cli.main(["topics", "list", "--run-dir", str(cfg.run_path)]) == 0
    out, _ = capfd.readouterr()
    assert f"{cfg.broker.topic_prefix}buffer.metrics" in out and "is over" not in out

    nothing = tmp_path / "nothing"
    nothing.mkdir()
    gone = cfg.with_overrides(broker={"bootstrap_servers": f"127.0.0.1:{free_port()}"})
    (nothing / "config.yaml").write_text(gone.to_yaml())
    assert cli.main(["topics", "list", "--run-dir", str(nothing)]) == 2
    _, err = capfd.readouterr()
    assert f"no broker answers at {gone.broker.bootstrap_servers}, and no archive to read instead" in err


def test_the_example_consumer_tails_a_finished_runs_archive(finished_run):
    result = subprocess.run([sys.executable, str(EXAMPLE), "--config", str(finished_run / "config.yaml"),
                             "--topic", "buffer.metrics"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == METRICS_RECORDS and lines[0]["type"] == "Metrics"  # the value that is not Arrow: skipped
    assert over_line(finished_run) in result.stderr
    assert not any(text in result.stderr for text in LIBRDKAFKA_LOG), result.stderr
