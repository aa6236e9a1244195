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
  trainer_idle_frac     the trainer's time waiting for a batch (``collect_s`` less ``log_read_s``) over the window
  step_s, train_s       wall time per step, and the part the trainer computed (step less waiting)
  staleness_mean/max    of the groups trained in the window
  drop_rate             groups dropped / (dropped + trained) in the window (``dropped_<reason>`` per step);
                        drops_by_reason the same per reason
  log_share             what the log cost over the window's wall time: the trainer reading and decoding its
                        batches (``log_read_s``), the rollout worker encoding and producing (``log_write_s``)
                        and the processor's CPU (``processor_cpu_s``), each step's record's figures summed
                        (seconds of different cores: an upper bound of the log's share of a step); the parts
                        as log_read_share, log_write_share, processor_share
  stage_cores           each stage's and service's CPU over the window, in cores (read from /proc every
                        second while the run runs): what the side stages cost beside the two working ones
  vs_sync               trained_tokens_s over the sync schedule's of the same repeat

With ``--repeats N`` the schedules run interleaved (sync, one_step, async, sync, ...), so a machine that
slows down slows every schedule alike; each figure is the median over the repeats, with its spread
(min, max) for the main ones. The last line: async_vs_sync, one_step_vs_sync, async_vs_one_step (medians of
the per-repeat ratios, with their spread), async_drop_rate and log_share (async's medians).

    .venv/bin/python benchmarks/schedules.py [--steps 14] [--warmup 2] [--repeats 1] [--tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import ArchiveSource
from milestream.schemas import topics
from milestream_testkit.chaos import targets

SCHEDULES = ("sync", "one_step", "async")
TINY = ["model.name=tiny-random", "model.dtype=float32", "rollout.group_size=4", "trainer.batch_groups=2",
        "rollout.max_inflight_samples=8"]
SPREAD = ("trained_tokens_s", "step_s", "drop_rate", "log_share", "trainer_idle_frac")  # reported with (min, max)
TICK_S = os.sysconf("SC_CLK_TCK")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the window")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="the cap of the long-tailed lengths")
    parser.add_argument("--repeats", type=int, default=1, help="runs per schedule (interleaved); medians reported")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--tiny", action="store_true", help="the tiny random model and the tests' small settings")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args()


class CpuTrace:
    """Each stage's CPU seconds (all its processes, /proc utime + stime), sampled every ``every_s`` while a run
    runs: ``cores(start, end)`` is a stage's CPU per second of wall time between two moments."""

    def __init__(self, config_path: Path, every_s: float = 1.0) -> None:
        self.config_path, self.every_s = config_path, every_s
        self.samples: list[tuple[float, dict[tuple[str, int], float]]] = []  # (time, (stage, pid) -> CPU s)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "CpuTrace":
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.done.set()
        self.thread.join()

    def _sample(self) -> None:
        while not self.done.wait(self.every_s):
            if not self.config_path.exists():  # the run has not written its configuration yet
                continue
            cpu = {(stage, pid): seconds for stage, pids in targets(self.config_path).items() for pid in pids
                   if (seconds := cpu_seconds(pid)) is not None}
            self.samples.append((time.time(), cpu))

    def cores(self, start: float, end: float) -> dict[str, float]:
        before = max((s for s in self.samples if s[0] <= start), default=None, key=lambda s: s[0])
        after = max((s for s in self.samples if s[0] <= end), default=None, key=lambda s: s[0])
        if before is None or after is None or after[0] <= before[0]:
            return {}
        used: dict[str, float] = {}
        for (stage, pid), seconds in after[1].items():  # a process started within the window counts from 0
            used[stage] = used.get(stage, 0.0) + seconds - before[1].get((stage, pid), 0.0)
        return {stage: round(seconds / (after[0] - before[0]), 3) for stage, seconds in sorted(used.items())}


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime (fields 14 and 15 of stat)


def run_schedule(args: argparse.Namespace, schedule: str, run_dir: Path) -> CpuTrace:
    overrides = [f"run.run_dir={run_dir}", f"run.schedule={schedule}", f"trainer.steps={args.steps}",
                 "rollout.generate_fn=benchmarks.long_tail:lognormal_length",
                 f"rollout.max_new_tokens={args.max_new_tokens}", "eval.mode=null", "run.max_wall_s=3600",
                 *(TINY if args.tiny else []), *args.overrides]
    command = [sys.executable, "-m", "milestream.cli", "run", *(a for o in overrides for a in ("--set", o))]
    with open(run_dir.with_suffix(".log"), "w") as log, CpuTrace(run_dir / "config.yaml") as trace:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = run_dir.with_suffix(".log").read_text(errors="replace").splitlines()[-10:]
        raise SystemExit(f"the {schedule} run failed ({code}):\n" + "\n".join(tail))
    return trace


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


def measure(run_dir: Path, warmup: int, trace: CpuTrace) -> dict:
    lineage = archived_lineage(run_dir)
    steps = lineage.trainer_steps()
    start = next(s.ts for s in steps if s.step == warmup)
    window = [s for s in steps if s.step > warmup]
    wall = window[-1].ts - start
    total = lambda name: sum(s.values.get(name, 0.0) for s in window)  # noqa: E731
    tokens = sum(s.values["response_len_mean"] * s.values["samples"] for s in window)
    lags = [lag for s in window for lag in s.group_staleness]
    trained = sum(len(s.group_ids) for s in window)
    by_reason = {k.removeprefix("dropped_"): total(k) for k in sorted({k for s in window for k in s.values})
                 if k.startswith("dropped_") and total(k)}
    dropped = sum(by_reason.values())
    log_parts = {"log_read_share": total("log_read_s") / wall, "log_write_share": total("log_write_s") / wall,
                 "processor_share": total("processor_cpu_s") / wall}
    return {"trained_tokens_s": round(tokens / wall, 2), "gen_utilisation": round(busy_over(run_dir, start, window[-1].ts), 3),
            "trainer_idle_frac": round((total("collect_s") - total("log_read_s")) / wall, 3),
            "step_s": round(wall / len(window), 2),
            "train_s": round(statistics.mean(s.values["step_s"] - s.values["collect_s"] for s in window), 2),
            "staleness_mean": round(statistics.mean(lags), 3), "staleness_max": max(lags),
            "drop_rate": round(dropped / (dropped + trained), 3), "drops_by_reason": by_reason,
            "log_share": round(sum(log_parts.values()), 4), **{k: round(v, 4) for k, v in log_parts.items()},
            "stage_cores": trace.cores(start, window[-1].ts), "window_steps": len(window),
            "window_s": round(wall, 1), "trained_tokens": round(tokens), "audit_exact": audit_run(run_dir).exact}


def summary(runs: list[dict]) -> dict:
    """The medians of a schedule's runs (a table of figures: the medians of each), every audit exact, and the
    spread (min, max) of the main figures."""
    out: dict = {}
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, dict):
            names = sorted({name for v in values for name in v})
            out[key] = {name: statistics.median(v.get(name, 0.0) for v in values) for name in names}
        else:
            out[key] = statistics.median(values)
    out["spread"] = {key: [min(r[key] for r in runs), max(r[key] for r in runs)] for key in SPREAD}
    return out


def ratios(results: dict[str, list[dict]], a: str, b: str) -> tuple[float, list[float]] | None:
    """The median of a's trained tokens/s over b's, repeat by repeat, and the spread of those ratios."""
    if a not in results or b not in results:
        return None
    each = [x["trained_tokens_s"] / y["trained_tokens_s"] for x, y in zip(results[a], results[b])]
    return round(statistics.median(each), 3), [round(min(each), 3), round(max(each), 3)]


def main() -> None:
    args = parse_args()
    results: dict[str, list[dict]] = {s: [] for s in args.schedules}
    with tempfile.TemporaryDirectory() as workdir:
        for repeat in range(args.repeats):
            for schedule in args.schedules:
                run_dir = Path(workdir) / f"{schedule}-{repeat}"
                trace = run_schedule(args, schedule, run_dir)
                results[schedule].append(measure(run_dir, args.warmup, trace))
                print(json.dumps({"schedule": schedule, "repeat": repeat, **results[schedule][-1]}), flush=True)
    for schedule, runs in results.items():
        vs_sync = ratios(results, schedule, "sync")
        print(json.dumps({"schedule": schedule, **summary(runs), "vs_sync": vs_sync and vs_sync[0],
                          "runs": args.repeats, "model": "tiny-random" if args.tiny else "default"}))
    final: dict = {}
    for name, a, b in (("async_vs_sync", "async", "sync"), ("one_step_vs_sync", "one_step", "sync"),
                       ("async_vs_one_step", "async", "one_step")):
        if (ratio := ratios(results, a, b)) is not None:
            final[name], final[f"{name}_spread"] = ratio
    if "async" in results:
        final |= {"async_drop_rate": summary(results["async"])["drop_rate"],
                  "log_share": summary(results["async"])["log_share"]}
    print(json.dumps({**final, "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
                      "max_new_tokens": args.max_new_tokens}))


if __name__ == "__main__":
    main()
