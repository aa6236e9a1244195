"""``milestream compare RUN_A RUN_B ...``: runs' step figures side by side, in one PNG and one table.

Each run is read from its archive (RUN_DIR/archive: a loop's, or a fork's, observe/fork.py), so a fork and the
run it came from compare as any two runs. ``compare.png`` has one panel per figure that some run recorded: the
training reward, the held-out score of each evaluated version (``milestream eval``, at the version's step), the
loss, the gradient norm, the KL between the rollout and the trainer's policy on the trained tokens
(``kl_rollout_train``), the KL to the reference (``kl_ref``, with trainer.kl_loss_coef) and the PPO clip
fraction. ``compare.md`` is the table: per run its steps, the means over the last quarter of the steps every run trained
(so that a fork and its original are compared on the same steps), its last held-out score, its wall time and,
for a fork, where it came from.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from milestream.observe.feed import archived
from milestream.observe.series import RunSeries, evaluated

PANELS = {  # figure on the step records -> its panel's title
    "reward_mean": "training reward (mean of the step's samples)",
    "heldout": "held-out score (greedy, per evaluated version)",
    "loss": "loss",
    "grad_norm": "gradient norm (before clipping)",
    "kl_rollout_train": "KL(rollout || trainer) per trained token",
    "kl_ref": "KL to the reference per token",
    "ppo_clip_frac": "PPO clip fraction",
}
TABLED = ("reward_mean", "loss", "grad_norm", "kl_rollout_train", "ppo_clip_frac")


@dataclass(frozen=True)
class ComparedRun:
    name: str
    folder: Path
    curves: dict[str, list[tuple[int, float]]]  # figure -> (step, value), in step order
    facts: dict  # summary.json's wall_s, and fork.json when the run is a fork

    @classmethod
    def read(cls, folder: str | Path) -> "ComparedRun":
        folder = Path(folder)
        series = RunSeries().observe_all(archived(folder))
        steps = series.lineage.trainer_steps()
        curves = {name: [(m.step, m.values[name]) for m in steps if name in m.values] for name in PANELS}
        for name, results in evaluated(series.evals).items():
            curves["heldout" if name == "heldout" else f"heldout/{name}"] = [(r.step, r.score) for r in results]
        facts = {}
        for file, keys in (("summary.json", ("wall_s",)), ("fork.json", ("from", "step", "changed"))):
            if (folder / file).exists():
                loaded = json.loads((folder / file).read_text())
                facts.update({key: loaded[key] for key in keys if key in loaded})
        return cls(folder.name, folder, {k: v for k, v in curves.items() if v}, facts)

    @property
    def label(self) -> str:
        if "from" not in self.facts:
            return self.name
        changed = ", ".join(f"{k}={after}" for k, (_, after) in self.facts["changed"].items()) or "no change"
        return f"{self.name} (fork of {Path(self.facts['from']).name} at step {self.facts['step']}: {changed})"


def shared_window(runs: Sequence[ComparedRun]) -> tuple[int, int] | None:
    """The last quarter of the steps every run trained, which the table's means are taken over: a fork and its
    original (steps 21-60 against 1-60) are compared on the same steps. None when the runs share no step."""
    shared = sorted(set.intersection(*({s for s, _ in run.curves.get("reward_mean", [])} for run in runs)))
    if not shared:
        return None
    tail = shared[-max(1, len(shared) // 4):]
    return tail[0], tail[-1]


def window_mean(points: Sequence[tuple[int, float]], window: tuple[int, int] | None) -> float | None:
    """The mean over ``window``'s steps, or over the last quarter of the points when there is no window."""
    chosen = points[-max(1, len(points) // 4):] if window is None else [
        (s, v) for s, v in points if window[0] <= s <= window[1]]
    values = [v for _, v in chosen if math.isfinite(v)]
    return sum(values) / len(values) if values else None


def table(runs: Sequence[ComparedRun]) -> str:
    """The comparison as a Markdown table."""
    window = shared_window(runs)
    over = "each run's last quarter" if window is None else f"steps {window[0]}-{window[1]}"
    head = ["run", "steps", *(f"{name} ({over})" for name in TABLED), "held-out (last)", "wall s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        steps = [s for s, _ in run.curves.get("reward_mean", [])]
        heldout = run.curves.get("heldout", [])
        cells = [run.label, f"{steps[0]}-{steps[-1]}" if steps else "-",
                 *(_shown(window_mean(run.curves.get(name, []), window)) for name in TABLED),
                 _shown(heldout[-1][1] if heldout else None), _shown(run.facts.get("wall_s"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _shown(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def plot(runs: Sequence[ComparedRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name in dict.fromkeys(n for run in runs for n in run.curves)]
    columns = 2
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(12, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for run in runs:
            points = run.curves.get(name, [])
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", ms=2.5, label=run.label)
        ax.set(title=PANELS.get(name, name), xlabel="trainer step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=1, fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.15 + 0.2 * len(runs)) / (3.2 * rows)))  # the legend's inches on top
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compare_runs(folders: Sequence[str | Path], out: str | Path) -> tuple[Path, str]:
    """``out``/compare.png and ``out``/compare.md of the runs in ``folders``; the PNG's path and the table."""
    runs = [ComparedRun.read(folder) for folder in folders]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(runs)
    (out / "compare.md").write_text(text)
    plot(runs, out / "compare.png")
    return out / "compare.png", text
