"""Fuzzing the data plane: hostile records into every topic a stage of ``milestream run`` reads, while it runs.

``milestream run`` (the tiny model and the tests' small settings, ``buffer.max_record_bytes`` 1 MiB) runs as
its own process with its embedded broker and Redis. Once its topics exist, ``--records`` hostile records
(milestream_testkit/fuzz_records.py, seeded: random bytes, truncated Arrow, another schema or version, a column
missing, extra, mistyped or null, no rows, values over buffer.max_record_bytes or the broker's limit, records that
decode but that no stage writes, some claiming a live group's id; hostile keys and headers) go to prompts,
rollout.trajectories, .logprobs, .routing, buffer.groups, weights.versions, weights.applied, buffer.metrics,
buffer.dropped and eval.results, paced over ``--inject-s`` seconds (default: 0.6 of the baseline's wall
time; the run's first ~50 s are start-up, so ``--steps`` 30 keeps training going for most of it) and
interleaved with the run's own records. The same run without them is the baseline (``--no-baseline``
skips it). At the end the run is read back from its archive and one JSON line is printed:

  records_sent       what the broker took, by topic and by kind; refused_by_broker: values over a topic's
                     max.message.bytes (never on the log)
  dead_lettered      hostile records with a dead letter at their topic, partition and offset; naming_all: of
                     those, how many have a letter that names its field and whose error names the position
  ignored            hostile records of the kinds milestream_testkit/fuzz_records.py calls ignorable (a weight
                     version no newer than the trainer's, with checksums of its own; a metrics record of a
                     source other than the trainer) that no stage dead-lettered: every reader passed over them
  unread             hostile prompts at or past the rollout workers' committed offset when the run ended, and
                     buffer.groups records at or past the trainer's last checkpoint: those readers read on
                     demand, and the run ended before they asked for that much
  swallowed          the rest: neither dead-lettered, ignored nor unread (by topic and kind); must be 0
  letters_not_ours   dead letters at positions the fuzzer did not write: good records some stage refused
  crashes            stage restarts (a ``==== life 2`` in a stage's log, ``exited with`` in the run's output)
                     and tracebacks in the stages' logs; must be 0
  good_records_lost  the audit (log/audit.py): groups lost, duplicated, trained and dropped, steps missing,
                     steps made of those planned; complete groups without an outcome; drops by reason
  window             the run's wall time against the baseline's, and each group's join latency (its first
                     source record to its buffer.groups / buffer.dropped record) p50 and max against
                     buffer.incomplete_after_s, the window a group has to complete

    .venv/bin/python benchmarks/fuzz.py [--records 10000] [--seed 0] [--steps 30] [--no-baseline] [--set section.key=value]
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from milestream.config import Config, load_config
from milestream.infra.kafka import Admin, KafkaError, RecordProducer, topic_name
from milestream.log.accounting import rollout_group, trainer_position
from milestream.log.archive import ArchiveState
from milestream.log.audit import archived_lineage, audit_run
from milestream.log.lineage import dead_lettered
from milestream.log.reader import SkipBadRecords, read_archive_fields
from milestream.schemas import topics
from milestream.schemas.codec import Position
from milestream.infra.secret_env import run_environment
from milestream.streams.ledger import BufferLedger
from milestream_testkit.fuzz_records import Hostile, HostileRecords

TINY = ["model.name=tiny-random", "model.dtype=float32", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "rollout.max_inflight_samples=8", "trainer.batch_groups=2", "trainer.checkpoint_every=1", "eval.mode=null",
        f"buffer.max_record_bytes={1024 * 1024}", "run.max_wall_s=3600"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--inject-s", type=float, help="spread the records over this long (default: 0.6 of the "
                        "baseline's wall time, or 60 s without one)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--run-dir", help="default: a temporary folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    return parser.parse_args()


class Run:
    """``milestream run`` as a child process."""

    def __init__(self, overrides: list[str], run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.started = run_dir, time.monotonic()
        command = [sys.executable, "-m", "milestream.cli", "run", *(a for o in overrides for a in ("--set", o))]
        self.redis_password = secrets.token_urlsafe(32)  # its embedded Redis's: known here to read the ledger
        with open(run_dir / "run.out", "w") as out, open(run_dir / "run.err", "w") as err:
            self.proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=run_environment(self.redis_password))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def config(self, timeout_s: float = 300.0) -> Config:
        """The run's configuration once its broker is up and its topics exist."""
        deadline, path = time.monotonic() + timeout_s, self.run_dir / "config.yaml"
        while time.monotonic() < deadline and self.alive():
            if path.exists():
                cfg = load_config(path).with_overrides(redis={"password": self.redis_password})
                names = {topic_name(cfg.broker, spec) for spec in topics.CATALOGUE}
                if names <= set(Admin(cfg.broker).list_topics()):
                    return cfg
            time.sleep(0.5)
        raise RuntimeError(f"the run's topics never came up: {self.tail()}")

    def step(self) -> int:
        """The newest trainer step the run printed."""
        lines = (self.run_dir / "run.out").read_text(errors="replace").splitlines()
        return max((int(line.split()[1].split("/")[0]) for line in lines if line.startswith("step ")), default=0)

    def finish(self, hang_guard_s: float = 1800.0) -> tuple[int, float]:
        code = self.proc.wait(timeout=hang_guard_s)
        return code, time.monotonic() - self.started

    def tail(self) -> list[str]:
        return (self.run_dir / "run.err").read_text(errors="replace").splitlines()[-5:]


@dataclass
class Sent:
    """Where each hostile record landed (or the broker's refusal), without its bytes."""

    landed: list[tuple[str, str, bool, Position]] = field(default_factory=list)  # (topic, kind, ignorable, where)
    refused: collections.Counter = field(default_factory=collections.Counter)

    def delivered(self, hostile: Hostile, outcome: Position | KafkaError) -> None:
        if isinstance(outcome, Position):
            self.landed.append((hostile.spec.name, hostile.kind, hostile.ignorable, outcome))
        else:
            self.refused[f"{hostile.spec.name}/{hostile.kind}"] += 1


def inject(cfg: Config, run: Run, records: int, seed: int, inject_s: float, last_step: int) -> Sent:
    """``records`` hostile values at an even pace, the generator kept told of the live groups and the trainer's
    version; it stops early if the run is within ``last_step`` of its end (its stages must see them all)."""
    hostile, ledger, sent = HostileRecords(cfg, seed), BufferLedger(cfg), Sent()
    producer = RecordProducer(cfg.broker, client_id="fuzz")
    started, refreshed = time.monotonic(), 0.0
    for i in range(records):
        time.sleep(max(0.0, started + i * inject_s / records - time.monotonic()))
        if time.monotonic() - refreshed > 0.5:
            if not run.alive() or run.step() >= last_step:
                print(f"fuzz: the run is at its end; {i} records sent", file=sys.stderr, flush=True)
                break
            hostile.live_groups, hostile.trainer_version = list(ledger.in_flight()), ledger.trainer_version() or 0
            refreshed = time.monotonic()
        record = hostile.make(hostile.pick_topic())
        producer.send_raw(record.spec, record.value, record.key, record.headers,
                          delivered=functools.partial(sent.delivered, record))
    producer.flush(120.0)
    return sent


def letters_of(run_dir: Path) -> dict[tuple[str, int, int], list[tuple[str, str]]]:
    """(full topic, partition, offset) -> (field, error) of each dead letter at that position."""
    out = collections.defaultdict(list)
    columns = ["source_topic", "partition", "offset", "field", "error"]
    for message in read_archive_fields(run_dir, topics.DEADLETTER, columns, SkipBadRecords()):
        for r in message.records:
            out[(r["source_topic"], r["partition"], r["offset"])].append((r["field"], r["error"]))
    return out


def outcomes(cfg: Config, run_dir: Path, sent: Sent) -> dict:
    letters = letters_of(run_dir)
    # where each reader that reads on demand had got to: rollout's committed prompts, the trainer's checkpoint
    read_up_to = {topics.PROMPTS.name: ArchiveState.load(run_dir).groups.get(rollout_group(cfg), {}).get(
        topics.PROMPTS.name, {}), topics.GROUPS.name: trainer_position(run_dir).offsets}
    counts, swallowed, sent_by = collections.Counter(), collections.Counter(), collections.Counter()
    ours = set()
    for topic, kind, ignorable, where in sent.landed:
        key = (where.topic, where.partition, where.offset)
        ours.add(key)
        sent_by[f"{topic}/{kind}"] += 1
        if key in letters:
            counts["dead_lettered"] += 1
            counts["naming_all"] += any(f and f"[{where.partition}]@{where.offset}" in e for f, e in letters[key])
        elif ignorable:
            counts["ignored"] += 1
        elif topic in read_up_to and where.offset >= read_up_to[topic].get(where.partition, 0):
            counts["unread"] += 1
        else:
            swallowed[f"{topic}/{kind}"] += 1
    not_ours = [(k, v[0]) for k, v in letters.items() if k not in ours]
    by_topic = collections.Counter(topic for topic, *_ in sent.landed)
    return {"records_sent": len(sent.landed), "by_topic": dict(by_topic), "by_kind": dict(sorted(sent_by.items())),
            "refused_by_broker": dict(sent.refused), "dead_lettered": counts["dead_lettered"],
            "naming_all": counts["naming_all"], "ignored": counts["ignored"], "unread": counts["unread"],
            "swallowed": sum(swallowed.values()), "swallowed_by_kind": dict(swallowed),
            "letters": sum(len(v) for v in letters.values()), "letters_not_ours": len(not_ours),
            "letters_not_ours_examples": [[*k, f, e[:160]] for k, (f, e) in not_ours[:5]]}


def crashes(run_dir: Path) -> dict:
    logs = sorted((run_dir / "logs").glob("*.log"))
    restarted = [p.stem for p in logs if "==== life 2" in p.read_text(errors="replace")]
    exited = [line for line in (run_dir / "run.out").read_text(errors="replace").splitlines() if "exited with" in line]
    tracebacks = {p.stem: n for p in logs if (n := p.read_text(errors="replace").count("Traceback"))}
    return {"crashes": len(restarted) + len(exited), "restarted": restarted, "exited": exited, "tracebacks": tracebacks}


def losses(cfg: Config, run_dir: Path) -> dict:
    audit, lineage = audit_run(run_dir), archived_lineage(run_dir)
    dead = dead_lettered(letters_of(run_dir))
    samples = collections.defaultdict(set)
    for m in read_archive_fields(run_dir, topics.TRAJECTORIES, ["group_id", "sample_index"], SkipBadRecords()):
        if (m.topic, m.partition, m.offset) not in dead:
            samples[m.records[0]["group_id"]].update(r["sample_index"] for r in m.records)
    decided = lineage.emitted.keys() | lineage.drops.keys() | lineage.training().keys()
    complete = sum(len(s) == cfg.rollout.group_size and g not in decided for g, s in samples.items())
    return {"exact": audit.exact, "groups_lost": len(audit.groups_lost),
            "groups_duplicated": len(audit.groups_duplicated),
            "groups_trained_and_dropped": len(audit.groups_trained_and_dropped), "missing_steps": audit.missing_steps,
            "steps": audit.steps, "steps_planned": cfg.trainer.steps, "groups_trained": audit.groups_trained,
            "groups_dropped": lineage.drop_reasons(), "complete_groups_without_outcome": complete}


def join_latencies(run_dir: Path) -> list[float]:
    """Seconds from each group's first source record to its outcome (buffer.groups or buffer.dropped)."""
    dead = dead_lettered(letters_of(run_dir))
    first: dict[str, int] = {}
    for spec in (topics.TRAJECTORIES, topics.LOGPROBS):
        for m in read_archive_fields(run_dir, spec, ["group_id"], SkipBadRecords()):
            if (m.topic, m.partition, m.offset) not in dead:
                group = m.records[0]["group_id"]
                first[group] = min(first.get(group, m.timestamp_ms), m.timestamp_ms)
    out: dict[str, int] = {}
    for spec in (topics.GROUPS, topics.DROPPED):
        for m in read_archive_fields(run_dir, spec, ["group_id"], SkipBadRecords()):
            group = m.records[0]["group_id"]
            if (m.topic, m.partition, m.offset) not in dead and group in first:
                out[group] = min(out.get(group, m.timestamp_ms), m.timestamp_ms)
    return [(out[g] - first[g]) / 1000 for g in out]


def window(cfg: Config, wall_s: float, run_dir: Path, baseline: tuple[float, Path] | None) -> dict:
    def figures(latencies: list[float]) -> dict:
        return {"join_p50_s": round(statistics.median(latencies), 2) if latencies else None,
                "join_max_s": round(max(latencies), 2) if latencies else None}
    out = {"wall_s": round(wall_s, 1), **figures(join_latencies(run_dir)),
           "incomplete_after_s": cfg.buffer.incomplete_after_s}
    if baseline is not None:
        base_wall, base_dir = baseline
        out |= {"baseline_wall_s": round(base_wall, 1), "wall_ratio": round(wall_s / base_wall, 2),
                **{f"baseline_{k}": v for k, v in figures(join_latencies(base_dir)).items()}}
    return out


def main() -> None:
    args = parse_args()
    logging.getLogger("milestream.log.reader").setLevel(logging.CRITICAL)  # the hostile records, skipped on reading
    with tempfile.TemporaryDirectory() as workdir:
        root = Path(args.run_dir or workdir)
        overrides = lambda name: [f"run.run_dir={root / name}", *TINY, f"trainer.steps={args.steps}",  # noqa: E731
                                  *args.overrides]
        baseline = None
        if not args.no_baseline:
            run = Run(overrides("baseline"), root / "baseline")
            code, wall_s = run.finish()
            if code != 0:
                raise RuntimeError(f"the baseline run failed ({code}): {run.tail()}")
            baseline = (wall_s, root / "baseline")
        inject_s = args.inject_s or (baseline[0] * 0.6 if baseline else 60.0)
        run = Run(overrides("fuzzed"), root / "fuzzed")
        cfg = run.config()
        sent = inject(cfg, run, args.records, args.seed, inject_s, last_step=max(1, args.steps - 2))
        code, wall_s = run.finish()
        result = {"run_exit": code, "records_planned": args.records, "seed": args.seed, "inject_s": round(inject_s, 1)}
        if code != 0:
            result["run_error"] = run.tail()
        result |= outcomes(cfg, run.run_dir, sent) | crashes(run.run_dir)
        try:
            result["good_records_lost"] = losses(cfg, run.run_dir)
            result["window"] = window(cfg, wall_s, run.run_dir, baseline)
        except Exception as exc:  # noqa: BLE001 - an audit that fails (a bad record nobody dead-lettered) is a finding
            result["audit_error"] = repr(exc)[:500]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
