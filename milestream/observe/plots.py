"""``milestream plot``: PNG plots of a run from its topics or its archive.

Five files under ``RUN_DIR/plots/`` (or ``--out``): ``reward.png`` (the training reward, which counts
the format bonus, with the held-out scores of ``eval.results``, which do not, at the step of each
evaluated version), ``staleness.png``, ``queue.png``,
``throughput.png`` and ``drops.png`` (drops by reason over time). A live run is read from its
topics; a finished one from ``RUN_DIR/archive`` (the archiver keeps it while the run goes on, so
the archive also serves a live run, without a broker).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Literal, Sequence

from matplotlib.ticker import MaxNLocator

from milestream.config import Config
from milestream.log.archive import archive_dir
from milestream.observe.feed import TopicFeed, archived
from milestream.observe.series import RunSeries, evaluated
from milestream.schemas.records import EvalResult, Metrics

Source = Literal["auto", "archive", "topics"]
ROLLING = 5  # steps in the reward's rolling mean


def _rolling(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(i + 1, window) for i in range(len(values))]


def _reward(ax, series: RunSeries) -> bool:
    steps = [m for m in series.trainer_steps() if "reward_mean" in m.values]
    draw_rewards(ax, steps, evaluated(series.evals))
    ax.plot([m.step for m in steps], _rolling([m.values["reward_mean"] for m in steps], ROLLING),
            label=f"training reward, rolling mean ({ROLLING} steps)")
    ax.set(xlabel="trainer step", title="training reward per step, held-out score per evaluated version")
    return bool(steps)


def draw_rewards(ax, steps: Sequence[Metrics], evals: dict[str, list[EvalResult]]) -> None:
    """The training reward of each step and each evaluation's held-out score at the step of the version it
    scored (version 0: step 0), on one axis and told apart: the training reward counts the format bonus
    (data.format_reward), the held-out score does not (evaluate/evaluation.py)."""
    ax.plot([m.step for m in steps], [m.values["reward_mean"] for m in steps], marker="o", ms=3, alpha=0.5,
            label="training reward, mean of the step's samples (incl. the format bonus)")
    for name, results in evals.items():
        ax.plot([r.step for r in results], [r.score for r in results], marker="s", ms=5, linestyle="--",
                label=f"held-out score ({name}): greedy, no format bonus")
    ax.set_ylabel("training reward / held-out score")


def _staleness(ax, series: RunSeries) -> bool:
    steps = [m for m in series.trainer_steps() if "staleness_mean" in m.values]
    x = [m.step for m in steps]
    ax.plot(x, [m.values["staleness_mean"] for m in steps], label="mean")
    ax.plot(x, [m.values.get("staleness_max", 0.0) for m in steps], linestyle="--", label="max")
    ax.set(xlabel="trainer step", ylabel="versions", title="staleness of the trained groups")
    return bool(steps)


def _queue(ax, series: RunSeries) -> bool:
    points = series.queue_points()
    ax.step([t for t, _ in points], [size for _, size in points], where="post", label="groups queued")
    ax.set(xlabel="seconds since the run's first record", ylabel="groups", title="buffer queue size")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return bool(points)


def _throughput(ax, series: RunSeries) -> bool:
    points = series.throughput()
    ax.plot([s for s, _ in points], [rate for _, rate in points], marker="o", ms=3, label="trained tokens/s")
    ax.set(xlabel="trainer step", ylabel="tokens/s", title="training throughput")
    return bool(points)


def _drops(ax, series: RunSeries) -> bool:
    by_reason = series.drops_over_time()
    end = max((points[-1][0] for points in by_reason.values()), default=0.0)
    for reason, points in sorted(by_reason.items()):
        points = [(0.0, 0), *points, (end, points[-1][1])]  # every reason's count over the same span
        ax.step([t for t, _ in points], [n for _, n in points], where="post", label=reason)
    ax.set(xlabel="seconds since the run's first record", ylabel="groups dropped", title="drops by reason")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return bool(by_reason)


PLOTS: dict[str, Callable[..., bool]] = {
    "reward": _reward, "staleness": _staleness, "queue": _queue, "throughput": _throughput, "drops": _drops,
}


def write_plots(series: RunSeries, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(8, 4))
        if draw(ax, series):
            ax.legend(loc="best")
        else:
            ax.text(0.5, 0.5, "nothing recorded yet", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def load_series(cfg: Config, source: Source = "auto") -> RunSeries:
    """The run of ``cfg.run.run_dir``, from its archive (``auto`` when there is one) or its live topics."""
    if source == "archive" or (source == "auto" and (archive_dir(cfg.run_path) / "manifest.json").exists()):
        return RunSeries().observe_all(archived(cfg.run_path))
    feed = TopicFeed(cfg, f"{cfg.broker.topic_prefix}plot")
    try:
        return RunSeries().observe_all(feed.drain())
    finally:
        feed.close()


def plot_run(cfg: Config, source: Source = "auto", out_dir: str | Path | None = None) -> list[Path]:
    return write_plots(load_series(cfg, source), out_dir or cfg.run_path / "plots")
