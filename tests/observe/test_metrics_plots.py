"""`milestream plot --run-dir R` on an archived run: the archiver's Parquet segments, no broker, five PNGs."""
from __future__ import annotations

import io
import struct
import threading

import matplotlib.image
from metrics_records import STEPS, publish_run

from milestream import cli
from milestream.infra.kafka import RecordProducer
from milestream.log.archive import Archiver
from milestream.observe.plots import PLOTS, load_series
from milestream.observe.series import evaluated
from milestream.schemas import topics
from milestream.schemas.records import EvalResult

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def plotted_fraction(data: bytes) -> float:
    """The share of coloured pixels: the data's lines (axes, grid and text are grey)."""
    rgb = matplotlib.image.imread(io.BytesIO(data), format="png")[..., :3]
    return float(((rgb.max(axis=2) - rgb.min(axis=2)) > 0.3).mean())


def test_plots_of_an_archived_run(cfg, capsys):
    t0 = publish_run(cfg)
    producer = RecordProducer(cfg.broker)
    for version, score in ((0, 0.1), (2, 0.4)):  # held-out scores, drawn on the reward plot
        producer.send(topics.EVAL_RESULTS, [EvalResult("heldout", version, version, score, 0, "ok", "{}", t0 + version)])
    producer.flush()
    stop = threading.Event()
    stop.set()  # no live phase: archive what the topics hold, flush, stop
    Archiver(cfg, idle_s=1.0).run(stop)

    # read back from the archive alone: the run's figures, the bad value skipped
    series = load_series(cfg, "archive")
    assert sorted(series.steps) == list(range(1, STEPS + 1))
    assert series.drops_by("reason") == {"stale": 2, "filtered": 1}
    assert [size for _, size in series.queue_points()] == [1.0, 2.0, 3.0]
    assert [step for step, _ in series.throughput()] == list(range(1, STEPS + 1))
    assert [(r.step, r.score) for r in evaluated(series.evals)["heldout"]] == [(0, 0.1), (2, 0.4)]

    assert cli.main(["plot", "--run-dir", str(cfg.run_path)]) == 0  # no broker given, none needed
    written = capsys.readouterr().out
    for name in PLOTS:
        path = cfg.run_path / "plots" / f"{name}.png"
        assert f"wrote {path}" in written
        data = path.read_bytes()
        assert png_size(data) == (800, 400) and len(data) > 15_000, (name, len(data))
        assert plotted_fraction(data) > 0.003, name  # an empty plot has none
