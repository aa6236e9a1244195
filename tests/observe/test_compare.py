"""``milestream compare``: two archived runs (a loop's and a fork's log) side by side, one PNG and one table."""
from __future__ import annotations

import json
import threading

from metrics_records import STEPS, publish_run, trainer_step
from test_metrics_plots import plotted_fraction, png_size

from milestream import cli
from milestream.infra.kafka import RecordProducer
from milestream.log.archive import Archiver
from milestream.observe.compare import ComparedRun
from milestream.observe.fork import ForkLog
from milestream.schemas import topics
from milestream.schemas.records import EvalResult, Metrics


def test_compare_plots_a_run_and_its_fork_side_by_side(cfg, tmp_path, capsys):
    t0 = publish_run(cfg, bad_value=False)
    producer = RecordProducer(cfg.broker)
    producer.send(topics.EVAL_RESULTS, [EvalResult("heldout", 4, 4, 0.5, 0, "ok", "{}", t0 + 50)])
    producer.flush()
    stop = threading.Event()
    stop.set()
    Archiver(cfg, idle_s=1.0).run(stop)
    original = cfg.run_path

    fork = tmp_path / "lr-fork"
    log = ForkLog(fork, original, cfg.broker.topic_prefix)  # a fork's log, as observe/fork.py writes it
    for step in range(3, STEPS + 3):
        record = trainer_step(step, t0 + 100 + step)
        log.append(topics.METRICS, Metrics("trainer", step, record.ts, {**record.values, "reward_mean": 1.0,
                                                                        "kl_rollout_train": 0.01 * step}), "trainer")
    (fork / "fork.json").write_text(json.dumps({"from": str(original), "step": 2,
                                                "changed": {"trainer.lr": [1e-4, 1e-3]}}))

    out = tmp_path / "compared"
    assert cli.main(["compare", str(original), str(fork), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = (out / "compare.png").read_bytes()
    assert png_size(data)[0] == 1200 and plotted_fraction(data) > 0.003
    table = (out / "compare.md").read_text()
    assert table in printed
    # means over the last quarter of the steps both runs trained (3-4): step 4 alone, for the run and its fork
    assert "| reward_mean (steps 4-4) |" in table.splitlines()[0]
    rows = table.splitlines()[2:]
    assert len(rows) == 2
    assert rows[0].startswith(f"| {original.name} | 1-{STEPS} | 0.4 |") and rows[0].split(" | ")[-2] == "0.5"
    assert rows[1].startswith(f"| lr-fork (fork of {original.name} at step 2: trainer.lr=0.001) | 3-{STEPS + 2} | 1 |")
    assert set(ComparedRun.read(fork).curves) == {"reward_mean", "loss", "grad_norm", "kl_rollout_train"}
