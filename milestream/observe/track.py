"""``milestream track``: the run in TensorBoard, W&B and MLflow, each writer a consumer of the topics.

A writer reads buffer.metrics, buffer.dropped, weights.versions, weights.applied and eval.results (the
feed of every metrics consumer, observe/feed.py) and writes, per trainer step, one row: the trainer's
step record as published, the newest figures of every other stage (processor, rollout workers, verifier),
drops by reason (each group once), weight versions, each engine's acks, version and sync seconds, and
trained tokens; per held-out evaluation, its score at the step of the version it scored; once, the run's
configuration as hyper-parameters. These are the Prometheus endpoint's figures (observe/prometheus.py).

Exactly once. A writer's position is committed with the state it produced, as the trainer's is in its
checkpoint (infra/offsets.py): every ``observe.commit_s`` it makes what it wrote durable (``Sink.commit``),
then saves, atomically, the next offset of every partition it read together with its tally (the figures
that rows carry from other topics). Killed before the save, it resumes from the previous position and
meets again what it had written since: it recognises those points by their deterministic ids, the trainer
step of a row and the (evaluation, step) of a score, in what the store holds (``Sink.written``, read back
at start), and skips them. A store found behind the saved position (deleted, or another one) is refilled
from the beginning of the log, with the same skip. A step redone by a restarted trainer keeps its first
row: a tracker does not take points back (the audit and summary.json follow the later record).

Several writers share one process and one feed, read from the oldest of their positions; each skips what
lies before its own.
"""
from __future__ import annotations

import heapq
import importlib.util
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import xxhash

from milestream.config import Config, ConfigError
from milestream.infra.faults import hold
from milestream.observe.feed import Observed, TopicFeed, archived
from milestream.observe.series import step_tokens
from milestream.observe.sinks import MlflowSink, Sink, TensorBoardSink, WandbSink, Written
from milestream.schemas.records import Dropped, EvalResult, Metrics, WeightApplied, WeightVersion

log = logging.getLogger(__name__)
Offsets = dict[tuple[str, int], int]  # (topic, partition) -> next offset to read


@dataclass
class Tally:
    """What a row holds besides its trainer record, as the other topics have told it so far."""

    latest: dict[str, dict[str, float]] = field(default_factory=dict)  # source -> values of its newest record
    drops: dict[str, list[str]] = field(default_factory=dict)  # group id -> [reason, dropped_by] of its first drop
    versions: dict[str, dict[str, Any]] = field(default_factory=dict)  # version -> transport, bytes, publications
    acks: dict[str, dict[str, float]] = field(default_factory=dict)  # engine -> ok, failed, version, its ack's ts
    tokens: dict[str, float] = field(default_factory=dict)  # trainer step -> response tokens trained
    last_ts: float | None = None  # the previous trainer step record's time

    def observe(self, record: Any) -> None:
        match record:
            case Metrics():
                self.latest[record.source] = dict(record.values)
            case Dropped():
                self.drops.setdefault(record.group_id, [record.reason, record.dropped_by])
            case WeightVersion():
                version = self.versions.setdefault(str(record.version), {"published": []})
                version.update(transport=record.transport, bytes=record.num_bytes)
                version["published"].append(record.ts)
            case WeightApplied():
                ack = self.acks.setdefault(record.engine_id, {"ok": 0, "failed": 0})
                ack["ok" if record.ok else "failed"] += 1
                if record.ok and record.version >= ack.get("version", -1):
                    ack.update(version=record.version, ts=record.ts)

    def row(self, record: Metrics) -> dict[str, float]:
        """A trainer step record's row; the record counts towards the trained tokens from here on."""
        tokens = step_tokens(record)
        if tokens is not None:
            self.tokens[str(record.step)] = tokens  # a redone step counts once
        elapsed = record.ts - self.last_ts if self.last_ts is not None else 0.0
        elapsed = elapsed if elapsed > 0 else record.values.get("step_s", 0.0)
        self.last_ts = record.ts
        out = {f"trainer/{name}": value for name, value in record.values.items()}
        out["trainer/trained_tokens"] = sum(self.tokens.values())
        if tokens is not None and elapsed > 0:
            out["trainer/tokens_per_s"] = tokens / elapsed
        for source, values in sorted(self.latest.items()):
            if source != "trainer":
                out.update({f"{source}/{name}": value for name, value in values.items()})
        for (reason, dropper), count in _count(self.drops.values()).items():
            out[f"dropped/{reason}"] = out.get(f"dropped/{reason}", 0) + count
            out[f"dropped/{reason}/{dropper}"] = count
        return {**out, **self._weights()}

    def _weights(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.versions:
            newest = max(self.versions, key=int)
            out.update({"weights/versions_published": len(self.versions), "weights/version": int(newest),
                        "weights/version_bytes": self.versions[newest]["bytes"]})
        for engine, ack in sorted(self.acks.items()):
            out[f"weights/applied_ok/{engine}"] = ack["ok"]
            out[f"weights/applied_failed/{engine}"] = ack["failed"]
            if "version" in ack:
                out[f"weights/engine_version/{engine}"] = ack["version"]
                published = [ts for ts in self.versions.get(str(ack["version"]), {}).get("published", [])
                             if ts <= ack["ts"]]
                if published:
                    out[f"weights/sync_seconds/{engine}"] = ack["ts"] - max(published)
        return {key: float(value) for key, value in out.items()}


def _count(drops: Iterable[list[str]]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for reason, dropper in drops:
        out[reason, dropper] = out.get((reason, dropper), 0) + 1
    return dict(sorted(out.items()))


class Tracker:
    """One writer: its sink, its tally and its position, saved in ``position`` (a JSON file)."""

    def __init__(self, sink: Sink, position: Path, target: str, params: dict[str, Any]):
        self.sink, self.position, self.target = sink, position, target
        self.written = sink.written()
        saved = self._load()
        self.tally = Tally(**saved["tally"]) if saved else Tally()
        self.offsets: Offsets = {(t, p): o for t, p, o in saved["offsets"]} if saved else {}
        if not self.written.params:
            sink.hyperparameters(params)
            self.written.params = True
        self.moved = False  # read past its saved position
        self.fresh = 0  # points written since the position was saved

    def _load(self) -> dict | None:
        """The saved position, unless it is another store's or ahead of what the store holds."""
        try:
            saved = json.loads(self.position.read_text())
        except FileNotFoundError:
            return None
        if saved["target"] != self.target:
            log.warning("%s: saved for %s, not %s: reading the log from its beginning", self.position,
                        saved["target"], self.target)
            return None
        if not self.written.covers(Written(**saved["written"])):
            log.warning("%s holds less than its saved position says (%s < %s): reading the log from its beginning",
                        self.target, self.written, saved["written"])
            return None
        return saved

    def observe(self, item: Observed) -> None:
        at = (item.spec.name, item.position.partition)
        if item.position.offset < self.offsets.get(at, 0):
            return  # before this writer's position: another writer of the process needed it
        self.offsets[at] = item.position.offset + 1
        self.moved = True
        record = item.record
        if isinstance(record, Metrics) and record.source == "trainer":
            row = self.tally.row(record)
            if record.step > self.written.step:
                self.sink.row(record.step, record.ts, row)
                self.written.step = record.step
                self.fresh += 1
        elif isinstance(record, EvalResult):
            if record.status == "ok" and record.step > self.written.evals.get(record.name, -1):
                self.sink.evaluation(record.name, record.step, record.ts, record.score)
                self.written.evals[record.name] = record.step
                self.fresh += 1
        else:
            self.tally.observe(record)

    def commit(self) -> None:
        """What was written made durable, then the position saved with the tally (whole or not at all)."""
        if not self.moved:
            return
        self.sink.commit()
        if self.fresh:
            hold("tracker.committing")
        saved = {"target": self.target, "offsets": [[t, p, o] for (t, p), o in sorted(self.offsets.items())],
                 "written": asdict(self.written), "tally": asdict(self.tally)}
        staging = self.position.with_name(f".{self.position.name}.{os.getpid()}")
        staging.write_text(json.dumps(saved))
        staging.replace(self.position)
        self.moved, self.fresh = False, 0

    def close(self) -> None:
        self.commit()
        self.sink.close()


def check_writers(cfg: Config) -> None:
    """Every configured writer's library is installed (the trackers extra), before any stage starts."""
    needs = {"tensorboard": ["tensorboard"], "wandb": ["wandb"], "mlflow": ["mlflow"]}
    if (cfg.observe.mlflow_uri or "").startswith(("sqlite:", "local")):
        needs["mlflow"] += ["sqlalchemy", "alembic"]  # MLflow's SQL store
    missing = [f"{module} (for {writer})" for writer in cfg.observe.writers for module in needs[writer]
               if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"not installed: {', '.join(missing)}; the trackers extra has them: "
                         "pip install -e '.[trackers]' (./scripts/setup installs it)")


def run_identity(cfg: Config) -> tuple[str, str]:
    """The run's name in the trackers and its key: the same for a live run and for its archive read later."""
    folder = cfg.run_path.resolve()
    return cfg.observe.run_name or folder.name, xxhash.xxh64(str(folder).encode()).hexdigest()


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": 1e-4}}`` -> ``{"trainer.lr": 1e-4}``; lists and None as text."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out


def make_tracker(cfg: Config, writer: str) -> Tracker:
    observe, run_dir = cfg.observe, cfg.run_path.resolve()
    name, key = run_identity(cfg)
    params = flat(cfg.model_dump(mode="json"))  # secrets are never dumped (config.py)
    sink: Sink
    if writer == "tensorboard":
        target = str(Path(observe.tensorboard_dir or run_dir / "tensorboard").resolve() / name)
        sink = TensorBoardSink(Path(target))
    elif writer == "wandb":
        directory = Path(observe.wandb_dir or run_dir).resolve()
        target = f"wandb {observe.wandb} {observe.wandb_entity or ''}/{observe.wandb_project} {directory} {key}"
        sink = WandbSink(observe.wandb, observe.wandb_project, observe.wandb_entity, directory, name, key, params)
    elif writer == "mlflow":
        local = observe.mlflow_uri == "local"
        uri = f"sqlite:///{run_dir / 'mlflow.db'}" if local else observe.mlflow_uri
        target = f"mlflow {uri} {observe.mlflow_experiment}"
        sink = MlflowSink(uri, observe.mlflow_experiment, name, key, str(run_dir / "mlflow-artifacts") if local else None)
    else:
        raise ConfigError(f"no tracker {writer!r} (tensorboard, wandb, mlflow)")
    positions = run_dir / "tracking"  # one file per store: writing an old run elsewhere moves no live position
    positions.mkdir(parents=True, exist_ok=True)
    return Tracker(sink, positions / f"{writer}-{xxhash.xxh64(target.encode()).hexdigest()[:8]}.json", target, params)


def in_time(items: Iterable[Observed]) -> Iterator[Observed]:
    """A batch of the feed, which reads topic by topic, in the order it was published: each partition in offset
    order, the partitions merged by record time. So a row carries what the other topics said before its step,
    also when a writer catches up on a backlog."""
    partitions: dict[tuple[str, int], list[tuple[float, Observed]]] = {}
    for item in items:
        partitions.setdefault((item.spec.name, item.position.partition), []).append((item.record.ts, item))
    return (item for _, item in heapq.merge(*partitions.values(), key=lambda timed: timed[0]))


def resume_from(trackers: list[Tracker]) -> Offsets:
    """Where the shared feed starts: the oldest position of any writer (the beginning where one has none)."""
    keys = set.intersection(*(set(t.offsets) for t in trackers)) if trackers else set()
    return {k: min(t.offsets[k] for t in trackers) for k in keys}


def open_trackers(cfg: Config, writers: list[str]) -> list[Tracker]:
    """One tracker per writer, each at its saved position (under RUN_DIR/tracking)."""
    check_writers(cfg)
    hold("tracker.opening")
    return [make_tracker(cfg, writer) for writer in writers]


def track(cfg: Config, trackers: list[Tracker], stop: threading.Event, archive: Path | None = None) -> list[Tracker]:
    """Run ``trackers`` until ``stop`` (live), or over the archive of run ``archive`` until its end."""
    start = resume_from(trackers)
    last_commit = time.monotonic()

    def feed(items: Iterable[Observed]) -> None:
        nonlocal last_commit
        for item in items:
            for tracker in trackers:
                tracker.observe(item)
        if time.monotonic() - last_commit >= cfg.observe.commit_s:
            for tracker in trackers:
                tracker.commit()
            last_commit = time.monotonic()

    try:
        if archive is not None:
            feed(archived(archive, start=start))
            return trackers
        topics = TopicFeed(cfg, f"{cfg.broker.topic_prefix}tracker", start=start)
        try:
            while not stop.is_set():
                feed(in_time(topics.poll(0.5)))
            # what the run published before it stopped this stage (its last evaluation: orchestrator.py)
            feed(in_time(topics.drain(idle_s=1.0, max_wait_s=20.0)))
        finally:
            topics.close()
    finally:
        for tracker in trackers:
            tracker.close()
    return trackers
