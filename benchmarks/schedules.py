"""The sync, one_step and async schedules (``run.schedule``) on the real loop, measured in one run.

Each schedule is a ``milestream run`` of its own (embedded broker and Redis, the stream processor, one
rollout worker with the CPU engine, the trainer; each stage capped at ``model.threads`` = 1 thread on
the machine's cores), with the same model, task, engine, ``rollout.max_inflight_samples``, batch and
steps. Response lengths are long-tailed whatever the model writes (benchmarks/long_tail.py: lognormal,
median max_new_tokens / 8, capped at max_new_tokens, the same lengths for the same prompts in every
schedule). Figures come from each run's archived log, over the steps after ``--warmup`` (start-up and
the first batches left out):

  trained_tokens_s      response tokens trained per second of the window
  gen_utilisation       the engine's time in prefill / decode steps over the window (CpuEngine.busy_s)
  trainer_idle_frac     the trainer's time waiting for a batch (``collect_s``) over the window
  step_s, train_s       wall time per step, and the part the trainer computed (step less waiting)
  staleness_mean/max    of the groups trained in the window
  drop_rate             groups dropped / (dropped + trained) in the window (``dropped_<reason>`` per step)
  vs_sync               trained_tokens_s over the sync schedule's (the last line: async_vs_sync, one_step_vs_sync)

    .venv/bin/python benchmarks/schedules.py [--steps 14] [--warmup 2] [--repeats 1] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import ArchiveSource
from milestream.schemas import topics

SCHEDULES = ("sync", "one_step", "async")
TINY = ["model.name=tiny-random", "model.dtype=float32", "rollout.group_size=4", "trainer.batch_groups=2",
        "rollout.max_inflight_samples=8"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the window")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="the cap of the long-tailed lengths")
    parser.add_argument("--repeats", type=int, default=1, help="runs per schedule (interleaved); medians reported")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model and the tests' small settings")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args()


def run_schedule(args: argparse.Namespace, schedule: str, run_dir: Path) -> None:
    overrides = [f"run.run_dir={run_dir}", f"run.schedule={schedule}", f"trainer.steps={args.steps}",
                 "rollout.generate_fn=benchmarks.long_tail:lognormal_length",
                 f"rollout.max_new_tokens={args.max_new_tokens}", "eval.mode=null", "run.max_wall_s=3600",
                 *(TINY if args.tiny else []), *args.overrides]
    command = [sys.executable, "-m", "milestream.cli", "run", *(a for o in overrides for a in ("--set", o))]
    with open(run_dir.with_suffix(".log"), "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = run_dir.with_suffix(".log").read_text(errors="replace").splitlines()[-10:]
        raise SystemExit(f"the {schedule} run failed ({code}):\n" + "\n".join(tail))


def busy_over(run_dir: Path, start: float, end: float) -> float:
    """The engines' busy seconds per second between ``start`` and ``end``: each worker's reports (every 5 s)
    from the last one at or before ``start`` to the first one at or after ``end``."""
    points: dict[str, list[tuple[float, float]]] = {}
    for message in ArchiveSource(run_dir).messages(topics.METRICS):
        for m in message.records:
            if m.source.startswith("rollout/"):
                points.setdefault(m.source, []).append((m.ts, m.values.get("engine_busy_s", 0.0)))
    rate = 0.0
    for reports in points.values():
        reports.sort()
        first = max((p for p in reports if p[0] <= start), default=reports[0])
        last = min((p for p in reports if p[0] >= end), default=reports[-1])
        rate += (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else 0.0
    return rate


def measure(run_dir: Path, warmup: int) -> dict:
    lineage = archived_lineage(run_dir)
    steps = lineage.trainer_steps()
    start = next(s.ts for s in steps if s.step == warmup)
    window = [s for s in steps if s.step > warmup]
    wall = window[-1].ts - start
    tokens = sum(s.values["response_len_mean"] * s.values["samples"] for s in window)
    lags = [lag for s in window for lag in s.group_staleness]
    trained = sum(len(s.group_ids) for s in window)
    dropped = sum(v for s in window for k, v in s.values.items() if k.startswith("dropped_"))
    waiting = sum(s.values["collect_s"] for s in window)
    audit = audit_run(run_dir)
    return {"trained_tokens_s": round(tokens / wall, 2), "gen_utilisation": round(busy_over(run_dir, start, window[-1].ts), 3),
            "trainer_idle_frac": round(waiting / wall, 3), "step_s": round(wall / len(window), 2),
            "train_s": round(statistics.mean(s.values["step_s"] - s.values["collect_s"] for s in window), 2),
            "staleness_mean": round(statistics.mean(lags), 3), "staleness_max": max(lags),
            "drop_rate": round(dropped / (dropped + trained), 3), "window_steps": len(window),
            "window_s": round(wall, 1), "trained_tokens": round(tokens), "audit_exact": audit.exact}


def main() -> None:
    args = parse_args()
    results: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for schedule in SCHEDULES:
                run_dir = Path(workdir) / f"{schedule}-{repeat}"
                run_schedule(args, schedule, run_dir)
                results[schedule].append(measure(run_dir, args.warmup))
    medians = {s: {k: statistics.median(r[k] for r in runs) if isinstance(runs[0][k], (int, float)) and
                   not isinstance(runs[0][k], bool) else all(r[k] for r in runs) for k in runs[0]}
               for s, runs in results.items()}
    sync = medians["sync"]["trained_tokens_s"]
    for schedule, figures in medians.items():
        print(json.dumps({"schedule": schedule, **figures, "vs_sync": round(figures["trained_tokens_s"] / sync, 3),
                          "runs": args.repeats, "model": "tiny-random" if args.tiny else "default"}))
    print(json.dumps({"async_vs_sync": round(medians["async"]["trained_tokens_s"] / sync, 3),
                      "one_step_vs_sync": round(medians["one_step"]["trained_tokens_s"] / sync, 3),
                      "steps": args.steps, "warmup": args.warmup, "max_new_tokens": args.max_new_tokens}))


if __name__ == "__main__":
    main()
