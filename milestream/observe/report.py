"""A run's report, built only from its topics: the lineage of buffer.metrics and buffer.dropped (log/lineage.py),
and the held-out evaluation's results on eval.results."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from milestream.log.lineage import Lineage
from milestream.observe.series import evaluated, not_evaluated
from milestream.schemas.records import EvalResult, Metrics


def _quarter_mean(values: Sequence[float], last: bool) -> float:
    if not values:
        return 0.0
    size = max(1, len(values) // 4)
    chunk = values[-size:] if last else values[:size]
    return sum(chunk) / len(chunk)


def summarise(lineage: Lineage, wall_s: float, stopped_by: str = "steps", evals: Sequence[EvalResult] = (),
              eval_name: str = "heldout") -> dict:
    steps = lineage.trainer_steps()
    rewards = [m.values["reward_mean"] for m in steps]
    lags = [lag for m in steps for lag in m.group_staleness]
    return {
        "steps": len(steps),
        "reward_first_quarter": _quarter_mean(rewards, last=False),
        "reward_last_quarter": _quarter_mean(rewards, last=True),
        "groups_trained": sum(len(m.group_ids) for m in steps),
        "groups_dropped": lineage.drop_reasons(),
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": max(lags) if lags else 0,
        "final_version": int(steps[-1].values["version"]) if steps else 0,
        "wall_s": wall_s,
        "stopped_by": stopped_by,
        **heldout_figures(evals, eval_name),
    }


def heldout_figures(evals: Sequence[EvalResult], name: str) -> dict:
    """The held-out scores (evaluation ``name``): the first and the last with their versions, every
    (version, step, score), and the versions whose evaluation was skipped, with the reason."""
    scores = [{"version": r.version, "step": r.step, "score": r.score} for r in evaluated(evals).get(name, [])]
    return {
        "heldout_first": scores[0] if scores else None,
        "heldout_last": scores[-1] if scores else None,
        "heldout": scores,
        "heldout_skipped": [{"version": r.version, "step": r.step, "reason": r.detail}
                            for r in not_evaluated(evals, name)],
    }


def write_report(run_dir: str | Path, lineage: Lineage, wall_s: float, stopped_by: str = "steps",
                 evals: Sequence[EvalResult] = (), eval_name: str = "heldout",
                 buffer: dict[str, int] | None = None) -> dict:
    """``buffer``: the ledger's balance once the stages stopped (``BufferLedger.balance``)."""
    run_dir = Path(run_dir)
    summary = summarise(lineage, wall_s, stopped_by, evals, eval_name) | ({"buffer": buffer} if buffer else {})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    steps = lineage.trainer_steps()
    with open(run_dir / "steps.jsonl", "w") as out:
        for m in steps:
            out.write(json.dumps({"step": m.step, "ts": m.ts, **m.values}) + "\n")
    if steps:
        plot(run_dir / "reward_staleness.png", steps, evaluated(evals))
    return summary


def plot(path: Path, steps: Sequence[Metrics], evals: dict[str, list[EvalResult]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from milestream.observe.plots import draw_rewards

    steps = sorted(steps, key=lambda m: m.step)
    x = [m.step for m in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    draw_rewards(top, steps, evals)
    top.legend(fontsize="small")
    top.grid(alpha=0.3)
    bottom.plot(x, [m.values["staleness_mean"] for m in steps], label="mean")
    bottom.plot(x, [m.values["staleness_max"] for m in steps], linestyle="--", label="max")
    bottom.set_ylabel("staleness (versions)")
    bottom.set_xlabel("trainer step")
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.suptitle("milestream run: reward, held-out score and staleness per step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
