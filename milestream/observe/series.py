"""A run as its topics tell it: the one aggregation behind the Prometheus endpoint, the live view and the plots.

Fed ``Observed`` records in any order across topics (within a topic, in offset order), it keeps:

- the latest ``Metrics`` record of every source (``trainer``, ``processor``, ``rollout/<worker>``, ``verifier``);
- the trainer's lineage and each dropped group once (``log/lineage.py``);
- the processor's queue size over time;
- every weight version's publication times and every engine's acks;
- every evaluation result (``eval.results``).
"""
from __future__ import annotations

import collections
from typing import Iterable, Sequence

from milestream.log.lineage import Lineage
from milestream.observe.feed import Observed
from milestream.schemas.records import Dropped, EvalResult, Metrics, WeightApplied, WeightVersion


class RunSeries:
    def __init__(self) -> None:
        self.latest: dict[str, Metrics] = {}
        self.lineage = Lineage()
        self.queue: list[tuple[float, float]] = []  # (ts, queue size) as the processor saw it
        self.versions: dict[int, WeightVersion] = {}  # the latest record of each version
        self.published: dict[int, list[float]] = collections.defaultdict(list)  # version -> publication times
        self.acks: list[WeightApplied] = []
        self.evals: list[EvalResult] = []
        self.first_ts: float | None = None

    @property
    def steps(self) -> dict[int, Metrics]:
        return self.lineage.steps

    @property
    def dropped(self) -> dict[str, Dropped]:
        return self.lineage.drops

    def observe(self, item: Observed) -> None:
        record = item.record
        self.lineage.observe(record, item.position)
        match record:
            case Metrics():
                self.latest[record.source] = record
                if record.source == "processor" and "queue_size" in record.values:
                    self.queue.append((record.ts, record.values["queue_size"]))
            case Dropped():
                pass  # the lineage keeps it; its time still counts towards the run's start
            case WeightVersion():
                self.versions[record.version] = record
                self.published[record.version].append(record.ts)
            case WeightApplied():
                self.acks.append(record)
            case EvalResult():
                self.evals.append(record)
            case _:
                return
        self.first_ts = record.ts if self.first_ts is None else min(self.first_ts, record.ts)

    def observe_all(self, items: Iterable[Observed]) -> "RunSeries":
        for item in items:
            self.observe(item)
        return self

    def since_start(self, ts: float) -> float:
        return ts - (self.first_ts or ts)

    def trainer_steps(self) -> list[Metrics]:
        return self.lineage.trainer_steps()

    def queue_points(self) -> list[tuple[float, float]]:
        """(seconds since the run's first record, groups queued): the processor's view, else the trainer's."""
        points = self.queue or [(m.ts, m.values["queue_size"])
                                for m in self.trainer_steps() if "queue_size" in m.values]
        return [(self.since_start(ts), size) for ts, size in sorted(points)]

    def throughput(self) -> list[tuple[int, float]]:
        """(step, response tokens trained per second over that step, from the previous step's record)."""
        out, previous = [], None
        for record in self.trainer_steps():
            tokens = step_tokens(record)
            elapsed = record.ts - previous.ts if previous is not None else 0.0
            if elapsed <= 0:  # the first step, or records out of time order after a restart
                elapsed = record.values.get("step_s", 0.0)
            if tokens is not None and elapsed > 0:
                out.append((record.step, tokens / elapsed))
            previous = record
        return out

    def tokens_trained(self) -> float:
        return sum(tokens for m in self.steps.values() if (tokens := step_tokens(m)) is not None)

    def drops_by(self, *fields: str) -> collections.Counter:
        """Dropped groups counted by the given Dropped fields (one field: plain keys, else tuples)."""
        if len(fields) == 1:
            return collections.Counter(getattr(d, fields[0]) for d in self.dropped.values())
        return collections.Counter(tuple(getattr(d, f) for f in fields) for d in self.dropped.values())

    def drops_over_time(self) -> dict[str, list[tuple[float, int]]]:
        """Per reason, (seconds since the run's first record, groups dropped so far for it)."""
        out: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        for drop in sorted(self.dropped.values(), key=lambda d: d.ts):
            points = out[drop.reason]
            points.append((self.since_start(drop.ts), (points[-1][1] if points else 0) + 1))
        return dict(out)

    def latest_version(self) -> WeightVersion | None:
        return self.versions[max(self.versions)] if self.versions else None

    def engine_versions(self) -> dict[str, int]:
        """Each engine's newest version it acknowledged holding."""
        out: dict[str, int] = {}
        for ack in self.acks:
            if ack.ok:
                out[ack.engine_id] = max(out.get(ack.engine_id, ack.version), ack.version)
        return out

    def sync_seconds(self) -> list[tuple[str, int, float]]:
        """(engine, version, seconds from the version's publication to the engine's ack) of each good ack."""
        out = []
        for ack in self.acks:
            before = [ts for ts in self.published.get(ack.version, ()) if ts <= ack.ts]
            if ack.ok and before:
                out.append((ack.engine_id, ack.version, ack.ts - max(before)))
        return out

    def figure(self, source: str, name: str) -> float | None:
        record = self.latest.get(source)
        return None if record is None else record.values.get(name)

    def sources(self, kind: str) -> dict[str, Metrics]:
        """The latest record of every source of one kind (``rollout`` -> ``rollout/worker-0``, ...)."""
        return {s: m for s, m in sorted(self.latest.items()) if s.partition("/")[0] == kind}


def evaluated(results: Iterable[EvalResult]) -> dict[str, list[EvalResult]]:
    """Each evaluation's scores by name: per version its latest ``ok`` result, in version order."""
    latest: dict[tuple[str, int], EvalResult] = {}
    for result in sorted(results, key=lambda r: r.ts):
        if result.status == "ok":
            latest[(result.name, result.version)] = result
    out: dict[str, list[EvalResult]] = {}
    for (name, _), result in sorted(latest.items()):
        out.setdefault(name, []).append(result)
    return out


def not_evaluated(results: Sequence[EvalResult], name: str) -> list[EvalResult]:
    """The latest ``skipped`` result of each version of evaluation ``name`` that has no ``ok`` one."""
    scored = {r.version for r in evaluated(results).get(name, [])}
    skipped = {r.version: r for r in sorted(results, key=lambda r: r.ts)
               if r.name == name and r.status != "ok" and r.version not in scored}
    return [skipped[version] for version in sorted(skipped)]


def step_tokens(record: Metrics) -> float | None:
    """Response tokens a trainer step trained (samples x mean response length), when the record says."""
    values = record.values
    if "samples" not in values or "response_len_mean" not in values:
        return None
    return values["samples"] * values["response_len_mean"]
