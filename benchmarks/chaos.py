"""Random SIGKILLs under ``milestream run`` (every stage, the embedded broker and Redis); the run audited from its log.

``milestream run`` runs as its own process, with its own embedded broker and Redis. Once it has made
``--warmup-steps`` steps, a killer waits a random ``--min-wait-s`` .. ``--max-wait-s`` seconds, and a
trainer step past the furthest one made before its last kill (so the run keeps making progress,
whatever it had to restart and redo), then picks a target at random among those alive at that moment and
SIGKILLs it: any stage ``milestream run`` started (a rollout worker, the processor, the trainer, the
archiver, the prompt feeder, the verifier, the metrics stage, the evaluator, the tracker; the teacher and
a vLLM server in runs that have them), the embedded broker or the embedded Redis. Targets are hit in
rounds: a target is picked among those not yet hit in the round, and a new round starts once every live
target was hit, so 30 kills reach each of the default run's 11 targets at least twice. None once the run is within
``--quiet-steps`` of its last step, so its end (summary, ledger balance) is left alone. The run gets
``run.max_restarts`` = kills + 2 and ``run.max_wall_s`` = 3600, and starts the optional stages a default run
lacks (``eval.mode=dedicated``, ``observe.tensorboard=true``), so they are killed too (``--set`` wins over all). It
supervises its stages and brings its services back (milestream/orchestrator.py). At the end the run is
audited from its archived log and its last checkpoint (log/audit.py), and one JSON line is printed:

  kills, kills_total    SIGKILLs that hit a live process, by target; kill_log: [seconds into the run, target];
                        never_killed: targets seen alive but never hit
  run_exit, run_error   the exit status of ``milestream run``, and its last lines when not 0
  steps                 trainer steps in the run's lineage (of ``steps_planned``); missing_steps, steps_redone
  groups_lost           groups on buffer.groups neither trained, dropped, nor waiting in the buffer
  groups_duplicated     groups trained more than once; groups_trained_and_dropped likewise
  exact                 none lost, duplicated, both trained and dropped, no step missing (log/audit.py)
  offending             when not exact: per offending group, its records on every topic, its decisions
                        (emitted, dropped, trained: by which stage life, at which step and trainer version;
                        log/audit.py ``explain``) and ``kills_around``: [time, target] of the kills within
                        ``--window-s`` of them (times: seconds since the epoch, as the decisions'). The run
                        folder is then kept, and its path printed (``run_dir``)
  complete_groups_without_outcome  every sample on rollout.trajectories, yet neither emitted nor dropped:
                        lost before buffer.groups (where the audit starts), or still in the processor at the end
  stalled               null, or the step after which no step came for ``--stall-s`` seconds, and the
                        ledger's balance then; the run is then stopped (SIGTERM: run_exit -15)
  credit_leaked         buffer.unaccounted: the ledger's balance once the stages stopped (summary.json),
                        or in the stall; ``buffer``: its terms
  in_flight_without_records  buffer.in_flight (the ledger's admitted groups) less the groups on
                        rollout.trajectories with no outcome: groups holding a credit of which the log
                        shows nothing (admitted, nothing published yet, when the run stopped or stalled)
  dead_letters          records on the dead-letter topic, by "source topic: field" (a run nobody attacks
                        should have none: each is a genuine record refused)
  reward_first, reward_last  mean training reward over the first and the last quarter of the steps
  max_gap_after_rollout_kill_s  the longest interval between two consecutive trainer step records (a
                        redone step counts: it is work done) that overlaps [kill, kill + --window-s] of a
                        rollout-worker kill (max_gap_after_kill_s:
                        the same for every target; gap_max_s: the longest of them, after a kill of gap_max_after)
  rollout_kill_gaps     per rollout-worker kill: its longest gap, and what else was killed near it
  baseline_median_gap_s the median interval between two steps with no kill of anything within that
                        window, in the same run; gap_ratio = max_gap_after_rollout_kill_s / it

    .venv/bin/python benchmarks/chaos.py --kills 30 [--seed 1] [--steps N] [--tiny] [--set section.key=value ...]
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milestream.config import load_config
from milestream.log.accounting import LoggedRun, trainer_position
from milestream.log.archive import archive_dir
from milestream.log.audit import archived_lineage, audit_run
from milestream.log.reader import ArchiveSource, read_archive_fields
from milestream.observe.report import summarise
from milestream.schemas import topics
from milestream.infra.secret_env import run_environment
from milestream.streams.ledger import BufferLedger
from milestream_testkit.chaos import SERVICES, STAGES, sigkill, targets

TINY = ["model.name=tiny-random", "model.dtype=float32", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "rollout.max_inflight_samples=8", "trainer.batch_groups=2", "trainer.checkpoint_every=1", "eval.mode=null"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, help="trainer.steps (default: the configuration's)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random model and the tests' small settings")
    parser.add_argument("--min-wait-s", type=float, default=5.0, help="the least time between two kills")
    parser.add_argument("--max-wait-s", type=float, default=20.0, help="the most time between two kills "
                        "(longer when the run has made no step since the last kill)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps before the first kill (part of "
                        "the baseline)")
    parser.add_argument("--quiet-steps", type=int, default=2, help="no kill within this many steps of the end")
    parser.add_argument("--window-s", type=float, default=30.0, help="how long after a kill a step interval "
                        "counts as after it (and not as the baseline)")
    parser.add_argument("--targets", default=",".join([*STAGES, *SERVICES]), help="what may be killed (comma-separated)")
    parser.add_argument("--stall-s", type=float, default=600.0, help="a run without a trainer step this long "
                        "is stalled: its ledger's balance is taken and it is interrupted")
    parser.add_argument("--run-dir", help="default: a temporary folder, removed unless the audit is not exact")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args()


def run_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The benchmark's settings first, the command line's ``--set`` last (they win)."""
    base = [f"run.run_dir={run_dir}", f"run.max_restarts={args.kills + 2}", "run.max_wall_s=3600",
            "eval.mode=dedicated", "observe.tensorboard=true"]
    base += TINY if args.tiny else []
    base += [f"trainer.steps={args.steps}"] if args.steps else []
    return base + args.overrides


class Run:
    """``milestream run`` as a child process; its archive tells how far its trainer got. A run whose
    trainer makes no step for ``stall_s`` is stalled: waiting for it stops there."""

    def __init__(self, overrides: list[str], run_dir: Path, stall_s: float):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.err_path, self.stall_s = run_dir, run_dir / "run.err", stall_s
        self.config_path = run_dir / "config.yaml"
        self.started = time.time()
        self.newest, self.moved = 0.0, time.monotonic()  # the newest step record's time, when it last changed
        command = [sys.executable, "-m", "milestream.cli", "run", *(a for o in overrides for a in ("--set", o))]
        self.redis_password = secrets.token_urlsafe(32)  # its embedded Redis's: known here to read the ledger
        env = run_environment(self.redis_password)
        with open(run_dir / "run.out", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def trainer_steps(self) -> list[tuple[int, float]]:
        """(step, trainer's time) of each step record archived so far: a step the run printed may have
        been made before a kill that came since, its record stamped when it was made is not. None before the
        archiver has written its manifest (the run is starting)."""
        if not (archive_dir(self.run_dir) / "manifest.json").exists():
            return []
        steps = [(r["step"], r["ts"]) for m in read_archive_fields(self.run_dir, topics.METRICS, ["source", "step", "ts"])
                 for r in m.records if r["source"] == "trainer"]
        if (newest := max((ts for _, ts in steps), default=0.0)) > self.newest:
            self.newest, self.moved = newest, time.monotonic()
        return steps

    def stalled_for(self) -> float | None:
        """Seconds without a new step, once that is ``stall_s`` or more (None before)."""
        self.trainer_steps()
        idle = time.monotonic() - self.moved
        return idle if idle >= self.stall_s else None

    def wait_for(self, condition, poll_s: float = 1.0) -> bool:
        """Until ``condition()``, the run ends, or it stalls; whether the condition came true."""
        while self.alive() and self.stalled_for() is None:
            if condition():
                return True
            time.sleep(poll_s)
        return False

    def finish(self, hang_guard_s: float) -> tuple[int, dict | None]:
        """Its exit status once it ends; a stalled run is interrupted, the ledger's balance taken first
        (nothing moves in a stall, so the balance is read as if the stages were stopped)."""
        self.wait_for(lambda: False)
        stall = None
        if self.alive():
            stalled_for = self.stalled_for()
            live = load_config(self.config_path).with_overrides(redis={"password": self.redis_password})
            buffer = BufferLedger(live).balance()
            stall = {"after_step": max((s for s, _ in self.trainer_steps()), default=0),
                     "for_s": round(stalled_for, 1), "buffer": buffer, "at": time.time()}
            self.proc.terminate()  # its stages and services get SIGTERM with it (die_with_parent)
        try:
            return self.proc.wait(timeout=hang_guard_s), stall
        finally:
            if self.alive():
                self.proc.kill()


def kill_at_random(args: argparse.Namespace, run: Run, planned: int,
                   rng: random.Random) -> tuple[list[tuple[float, str]], set[str]]:
    """SIGKILL ``args.kills`` random targets (see the module docstring); returns (time, target) of each hit,
    and every target seen alive when one was picked."""
    allowed = set(args.targets.split(","))
    kills: list[tuple[float, str]] = []
    hit_this_round: set[str] = set()
    seen: set[str] = set()
    reached = args.warmup_steps - 1  # the furthest step when the last kill came

    def progressed() -> bool:  # a step past that one, made after the kill (redone steps do not count)
        return any(step > reached and ts > (kills[-1][0] if kills else 0.0) for step, ts in run.trainer_steps())

    while len(kills) < args.kills and run.wait_for(progressed):
        time.sleep(rng.uniform(args.min_wait_s, args.max_wait_s))
        reached = max((step for step, _ in run.trainer_steps()), default=0)
        if not run.alive() or reached >= planned - args.quiet_steps:
            break
        alive = {name: ids for name, ids in targets(run.config_path).items() if name in allowed}
        if not alive:
            continue
        seen |= alive.keys()
        if not alive.keys() - hit_this_round:
            hit_this_round.clear()
        name = rng.choice(sorted(alive.keys() - hit_this_round))
        if sigkill(rng.choice(alive[name])):
            kills.append((time.time(), name))
            hit_this_round.add(name)
            print(f"kill {len(kills)}: {name} after step {reached}", file=sys.stderr, flush=True)
    return kills, seen


def step_gaps(step_ts: list[float], kills: list[tuple[float, str]], window_s: float, stalled_at: float | None) -> dict:
    """The intervals between consecutive steps after each kind of kill, against those after no kill; a
    stalled run's last step and its stall make the last interval."""
    intervals = list(zip(step_ts, step_ts[1:])) + ([(step_ts[-1], stalled_at)] if stalled_at and step_ts else [])

    def after(interval: tuple[float, float], times: list[float]) -> bool:
        start, end = interval
        return any(end > t and start < t + window_s for t in times)

    by_target = collections.defaultdict(list)
    for t, name in kills:
        by_target[name].append(t)
    longest = {name: round(max((b - a for a, b in intervals if after((a, b), times)), default=0.0), 2)
               for name, times in sorted(by_target.items())}
    quiet = [b - a for a, b in intervals if not after((a, b), [t for t, _ in kills])]
    baseline = statistics.median(quiet) if quiet else None
    rollout = longest.get("rollout")
    worst = max(longest, key=longest.__getitem__, default=None)
    return {"gap_max_s": longest.get(worst), "gap_max_after": worst,
            "max_gap_after_rollout_kill_s": rollout, "max_gap_after_kill_s": longest,
            "rollout_kill_gaps": rollout_kill_gaps(intervals, kills, window_s),
            "baseline_median_gap_s": round(baseline, 2) if baseline else None, "baseline_intervals": len(quiet),
            "gap_ratio": round(rollout / baseline, 2) if rollout and baseline else None}


def rollout_kill_gaps(intervals: list[tuple[float, float]], kills: list[tuple[float, str]],
                      window_s: float) -> list[dict]:
    """Per rollout-worker kill: the longest step interval overlapping its window, and the other targets
    killed within that interval or window (a Redis or broker kill there restarts every stage: the gap is
    then theirs as much as the worker's)."""
    out = []
    for t, name in kills:
        if name != "rollout":
            continue
        overlapping = [(b - a, a, b) for a, b in intervals if b > t and a < t + window_s]
        gap, start, end = max(overlapping, default=(0.0, t, t + window_s))
        others = sorted({n for u, n in kills if n != "rollout" and start - window_s < u < max(end, t + window_s)})
        out.append({"gap_s": round(gap, 2), "also_killed": others})
    return out


def complete_without_outcome(run_dir: Path, group_size: int, decided: set[str]) -> int:
    samples = collections.defaultdict(set)
    for message in read_archive_fields(run_dir, topics.TRAJECTORIES, ["group_id", "sample_index"]):
        for row in message.records:
            samples[row["group_id"]].add(row["sample_index"])
    return sum(len(indices) == group_size and group not in decided for group, indices in samples.items())


def dead_letters(run_dir: Path) -> dict[str, int]:
    counts = collections.Counter(f"{row['source_topic']}: {row['field']}"
                                 for message in read_archive_fields(run_dir, topics.DEADLETTER,
                                                                    ["source_topic", "field"])
                                 for row in message.records)
    return dict(sorted(counts.items()))


def audit_figures(run_dir: Path, group_size: int, kills: list[tuple[float, str]], window_s: float,
                  stalled_at: float | None) -> dict:
    """Everything but the ledger's balance from the archived log and the last checkpoint alone."""
    audit, lineage = audit_run(run_dir), archived_lineage(run_dir)
    summary = summarise(lineage, 0.0)
    offending = {group_id: {**evidence, "kills_around": kills_around(evidence["decisions"], kills, window_s)}
                 for group_id, evidence in audit.evidence.items()}
    decided = lineage.emitted.keys() | lineage.drops.keys() | lineage.training().keys()
    return {"steps": audit.steps, "groups_lost": len(audit.groups_lost),
            "groups_duplicated": len(audit.groups_duplicated),
            "groups_trained_and_dropped": len(audit.groups_trained_and_dropped),
            "complete_groups_without_outcome": complete_without_outcome(run_dir, group_size, decided),
            "groups_trained": audit.groups_trained, "groups_dropped": lineage.drop_reasons(),
            "steps_redone": audit.step_records - audit.steps, "missing_steps": audit.missing_steps,
            "exact": audit.exact, **({"offending": offending} if offending else {}),
            "dead_letters": dead_letters(run_dir),
            "reward_first": round(summary["reward_first_quarter"], 4),
            "reward_last": round(summary["reward_last_quarter"], 4),
            **step_gaps(step_record_times(run_dir), kills, window_s, stalled_at)}


def kills_around(decisions: list[dict], kills: list[tuple[float, str]], window_s: float) -> list[list]:
    """The kills from ``window_s`` before a group's first decision to ``window_s`` after its last."""
    times = [d["time"] for d in decisions]
    if not times:
        return []
    return [[round(t, 3), name] for t, name in kills if min(times) - window_s <= t <= max(times) + window_s]


def step_record_times(run_dir: Path) -> list[float]:
    """When each trainer step record was made, redone steps included, in time order: how long the trainer
    went without finishing a step (the lineage keeps only a redone step's later record, which would
    stretch the interval before it over the first attempts)."""
    return sorted(r["ts"] for m in read_archive_fields(run_dir, topics.METRICS, ["source", "ts"])
                  for r in m.records if r["source"] == "trainer")


def ledger_figures(run_dir: Path, buffer: dict | None) -> dict:
    """The ledger's balance at the end (or in a stall), and the admissions it counts in flight that no
    group on the log accounts for (see the module docstring)."""
    if buffer is None:
        return {"credit_leaked": None, "buffer": None, "in_flight_without_records": None}
    logged = LoggedRun.read(ArchiveSource(run_dir), trainer_position(run_dir))
    return {"credit_leaked": buffer["unaccounted"], "buffer": buffer,
            "in_flight_without_records": buffer["in_flight"] - len(logged.entered - logged.left)}


def chaos_run(args: argparse.Namespace, run_dir: Path) -> dict:
    """The run under random kills, audited: the JSON line's figures."""
    overrides = run_overrides(args, run_dir)
    cfg = load_config(None, overrides)
    started = time.monotonic()
    run = Run(overrides, run_dir, args.stall_s)
    try:
        kills, seen = kill_at_random(args, run, cfg.trainer.steps, random.Random(args.seed))
    finally:
        code, stall = run.finish(hang_guard_s=cfg.run.max_wall_s + 900)  # the run has its own budget
    stalled_at = stall.pop("at") if stall else None
    summary_path = run_dir / "summary.json"
    buffer = json.loads(summary_path.read_text()).get("buffer") if summary_path.exists() else None
    result = {"kills": dict(collections.Counter(name for _, name in kills)), "kills_total": len(kills),
              "never_killed": sorted(seen - {name for _, name in kills}),
              "kill_log": [[round(t - run.started, 1), name] for t, name in kills],
              "run_exit": code, "stalled": stall, "steps_planned": cfg.trainer.steps,
              "wall_s": round(time.monotonic() - started, 1)}
    if code != 0 and stall is None:  # a stalled run was interrupted here
        result["run_error"] = run.err_path.read_text(errors="replace").splitlines()[-5:]
    try:
        result |= ledger_figures(run_dir, buffer or (stall or {}).get("buffer"))
        result |= audit_figures(run_dir, cfg.rollout.group_size, kills, args.window_s, stalled_at)
    except Exception as exc:  # noqa: BLE001 - an unreadable log is a finding too
        result["audit_error"] = repr(exc)
    return result


def main() -> None:
    args = parse_args()
    workdir = None if args.run_dir else Path(tempfile.mkdtemp(prefix="milestream-chaos-"))
    run_dir = Path(args.run_dir) if args.run_dir else workdir / "chaos"
    if run_dir.exists() and any(run_dir.iterdir()):  # `milestream run` would resume that run, not start one
        sys.exit(f"--run-dir {run_dir} holds a run already: give a new or empty folder")
    result = chaos_run(args, run_dir)  # should it raise, its folder stays too
    if not result.get("exact"):  # the evidence survives the run: its folder is kept
        result["run_dir"] = str(run_dir)
        print(f"the audit is not exact: the run folder is kept at {run_dir}", file=sys.stderr)
        for group_id, evidence in result.get("offending", {}).items():
            print(f"offending group {group_id}: {json.dumps(evidence, indent=1)}", file=sys.stderr)
    elif workdir is not None:
        shutil.rmtree(workdir)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
