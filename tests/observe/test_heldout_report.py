"""The held-out figures of a run's report (summary.json) and its plot, from eval.results records."""
from __future__ import annotations

import json
import math

from milestream.log.lineage import Lineage
from milestream.observe.report import summarise, write_report
from milestream.observe.series import evaluated
from milestream.schemas.records import EvalResult, Metrics


def result(version: int, score: float, ts: float, status: str = "ok", name: str = "heldout") -> EvalResult:
    return EvalResult(name, version, version, score, 0, status, "{}" if status == "ok" else "timed out", ts)


EVALS = [
    result(0, 0.1, 1.0),
    result(10, math.nan, 2.0, status="skipped"),
    result(10, 0.3, 3.0),  # evaluated again (a restarted evaluator): the scored one counts
    result(20, 0.4, 4.0), result(20, 0.5, 5.0),  # the later of two results of a version wins
    result(20, 0.9, 6.0, name="heldout/other"),  # another evaluation's name: not in the held-out figures
    result(30, math.nan, 7.0, status="skipped"),
]


def test_summary_and_plot_hold_the_held_out_scores(tmp_path):
    lineage = Lineage()
    for step in range(1, 31):
        values = {"reward_mean": 0.01 * step, "staleness_mean": 0.5, "staleness_max": 1.0, "version": float(step)}
        lineage.observe(Metrics("trainer", step, float(step), values, [f"g{step}"], [1]), None)
    summary = write_report(tmp_path, lineage, 12.0, "wall_budget", evals=EVALS, eval_name="heldout")

    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["heldout_first"] == {"version": 0, "step": 0, "score": 0.1}
    assert summary["heldout_last"] == {"version": 20, "step": 20, "score": 0.5}
    assert [(s["version"], s["step"], s["score"]) for s in summary["heldout"]] == [(0, 0, 0.1), (10, 10, 0.3), (20, 20, 0.5)]
    assert summary["heldout_skipped"] == [{"version": 30, "step": 30, "reason": "timed out"}]
    assert summary["steps"] == 30 and summary["stopped_by"] == "wall_budget"  # the keys it always had
    assert (tmp_path / "reward_staleness.png").stat().st_size > 0
    assert set(evaluated(EVALS)) == {"heldout", "heldout/other"}


def test_a_run_without_evaluation_reports_none():
    summary = summarise(Lineage(), 1.0)
    assert (summary["heldout_first"], summary["heldout_last"], summary["heldout"], summary["heldout_skipped"]) == \
        (None, None, [], [])
