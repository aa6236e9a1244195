"""The reward plots (`milestream plot`'s reward.png, a run's reward_staleness.png) tell apart the training reward,
which counts the format bonus, and the held-out score, which does not: each series and the axis say which."""
from __future__ import annotations

from matplotlib.figure import Figure

from milestream.observe.feed import Observed
from milestream.observe.plots import PLOTS, draw_rewards
from milestream.observe.series import RunSeries
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.schemas.records import EvalResult, Metrics

STEPS = [Metrics("trainer", step, float(step), {"reward_mean": 0.1 * step}) for step in (1, 2, 3)]
EVALS = {"heldout": [EvalResult("heldout", version, version, 0.2 * version, 0, "ok", "{}", float(version))
                     for version in (0, 3)]}


def _labels(ax) -> list[str]:
    return ax.get_legend_handles_labels()[1]


def test_training_reward_and_held_out_score_are_told_apart():
    ax = Figure().subplots()
    draw_rewards(ax, STEPS, EVALS)
    assert _labels(ax) == ["training reward, mean of the step's samples (incl. the format bonus)",
                           "held-out score (heldout): greedy, no format bonus"]
    assert ax.get_ylabel() == "training reward / held-out score"


def test_the_plot_commands_reward_png_labels_its_rolling_mean_as_training_reward():
    series = RunSeries()
    for offset, record in enumerate([*STEPS, *EVALS["heldout"]]):
        spec = topics.METRICS if isinstance(record, Metrics) else topics.EVAL_RESULTS
        series.observe(Observed(spec, Position(spec.name, 0, offset), record))
    ax = Figure().subplots()
    assert PLOTS["reward"](ax, series)
    assert all(label.startswith(("training reward", "held-out score")) for label in _labels(ax)), _labels(ax)
    assert ax.get_title() == "training reward per step, held-out score per evaluated version"
