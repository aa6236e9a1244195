"""docs/consumers.md's example consumer (examples/tail_topic.py), run as the guide runs it, on the test broker."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from metrics_records import publish_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tail_topic.py"


def test_example_consumer_tails_a_topic(cfg):
    publish_run(cfg)
    cfg.run_path.mkdir(parents=True)
    (cfg.run_path / "config.yaml").write_text(cfg.to_yaml())
    result = subprocess.run([sys.executable, str(EXAMPLE), "--config", str(cfg.run_path / "config.yaml"),
                             "--topic", "buffer.metrics", "--idle-s", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["source"] for line in lines[:5]] == ["trainer"] * 5
    assert lines[0]["type"] == "Metrics" and lines[0]["values"]["reward_mean"] == 0.1
    assert lines[0]["at"] == f"{cfg.broker.topic_prefix}buffer.metrics[0]@0"
    assert {line["source"] for line in lines} == {"trainer", "processor", "rollout/worker-0", "verifier"}
    # the value that is not Arrow: reported with its position and field, and the consumer went on
    assert f"skipped: record at {cfg.broker.topic_prefix}buffer.metrics[0]@{len(lines)}: field '<value>'" \
        in result.stderr
