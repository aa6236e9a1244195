"""Exactly-once resume of the trainer under repeated SIGKILLs, against the same run left alone.

Two runs of ``milestream run`` on the tiny model, one after the other, with the same settings:
the baseline, untouched, and the chaos run, whose trainer is SIGKILLed ``--kills`` times at random
points (each kill waits for a new checkpoint, then a random 0-0.5 s: mid-step, between publishing a
step and checkpointing it, or during the start-up after the previous kill). The run supervises the
trainer, which resumes from its checkpoint. Then the archived log and the last checkpoint are
audited (log/audit.py, against log/lineage.py). Prints one JSON line:

  kills               SIGKILLs that hit a live trainer
  groups_lost         groups on buffer.groups neither trained, dropped, nor waiting in the buffer
  groups_duplicated   groups trained more than once in the run's lineage
  groups_trained_and_dropped   groups both trained and dropped
  steps_redone        step records published twice (a kill between publishing and checkpointing)
  exact               no group lost, duplicated or both trained and dropped, and no step missing
  wall_s / baseline_wall_s / ratio   the chaos run's time over the baseline's

    .venv/bin/python benchmarks/resume.py [--kills 20] [--steps 44] [--seed 1]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from milestream.config import Config
from milestream.train import checkpoint
from milestream.log.audit import audit_run
from milestream.infra.services import services
from milestream.orchestrator import run_loop
from milestream_testkit.chaos import sigkill, stage_pids


def settings(base: Config, run_dir: Path, steps: int, kills: int) -> Config:
    return base.with_overrides(
        model={"name": "tiny-random", "dtype": "float32"},
        rollout={"group_size": 4, "max_new_tokens": 6, "max_inflight_samples": 8},
        trainer={"batch_groups": 2, "steps": steps, "checkpoint_every": 1},
        run={"run_dir": str(run_dir), "max_wall_s": 3600, "max_restarts": kills + 2, "prometheus_port": None},
    )


def timed_run(cfg: Config) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        started = time.monotonic()
        outcome["summary"] = run_loop(cfg)
        outcome["wall_s"] = time.monotonic() - started

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, outcome


def kill_trainer(cfg: Config, runner: threading.Thread, kills: int, rng: random.Random) -> int:
    run_dir = Path(cfg.run.run_dir)
    config_path = run_dir / "config.yaml"
    landed = 0
    while landed < kills and runner.is_alive():
        progress = checkpoint.latest_step(run_dir)
        while runner.is_alive() and not (checkpoint.latest_step(run_dir) > progress and stage_pids(config_path, "train")):
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 0.5))
        landed += sum(sigkill(pid) for pid in stage_pids(config_path, "train")) > 0
    return landed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=44)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with services(Config()) as live, tempfile.TemporaryDirectory() as workdir:
        baseline_cfg = settings(live.with_overrides(broker={"topic_prefix": "bench-baseline."}),
                                Path(workdir) / "baseline", args.steps, args.kills)
        runner, baseline = timed_run(baseline_cfg)
        runner.join()
        chaos_cfg = settings(live.with_overrides(broker={"topic_prefix": "bench-chaos."}),
                             Path(workdir) / "chaos", args.steps, args.kills)
        runner, chaos = timed_run(chaos_cfg)
        kills = kill_trainer(chaos_cfg, runner, args.kills, random.Random(args.seed))
        runner.join()
        audit = audit_run(chaos_cfg.run.run_dir)
    print(json.dumps({
        "kills": kills, "groups_lost": len(audit.groups_lost), "groups_duplicated": len(audit.groups_duplicated),
        "groups_trained_and_dropped": len(audit.groups_trained_and_dropped),
        "steps": audit.steps, "steps_redone": audit.step_records - audit.steps, "groups_trained": audit.groups_trained,
        "groups_dropped": audit.groups_dropped, "groups_buffered": audit.groups_buffered, "exact": audit.exact,
        "wall_s": round(chaos["wall_s"], 1), "baseline_wall_s": round(baseline["wall_s"], 1),
        "ratio": round(chaos["wall_s"] / baseline["wall_s"], 3),
    }))


if __name__ == "__main__":
    main()
