"""The topic catalogue: every topic of the loop, its record type, key and sizing."""
from __future__ import annotations

from dataclasses import dataclass

from milestream.schemas import records as r


@dataclass(frozen=True)
class TopicSpec:
    name: str
    record: type[r.Record]
    key: str  # what the message key is
    keyed_partitions: bool = True  # False: one partition keeps a total order (versions, metrics)
    max_message_mb: int = 8


PROMPTS = TopicSpec("prompts", r.Prompt, "prompt id")
TRAJECTORIES = TopicSpec("rollout.trajectories", r.Trajectory, "group id")
LOGPROBS = TopicSpec("rollout.logprobs", r.LogProbs, "group id")
ROUTING = TopicSpec("rollout.routing", r.Routing, "group id", max_message_mb=64)
TEACHER_LOGPROBS = TopicSpec("rollout.teacher_logprobs", r.TeacherLogProbs, "group id")
GROUPS = TopicSpec("buffer.groups", r.GroupManifest, "group id")
DROPPED = TopicSpec("buffer.dropped", r.Dropped, "group id")
METRICS = TopicSpec("buffer.metrics", r.Metrics, "source", keyed_partitions=False)
WEIGHT_VERSIONS = TopicSpec("weights.versions", r.WeightVersion, "none", keyed_partitions=False)
WEIGHTS_APPLIED = TopicSpec("weights.applied", r.WeightApplied, "engine id")
EVAL_RESULTS = TopicSpec("eval.results", r.EvalResult, "none", keyed_partitions=False)
DEADLETTER = TopicSpec("deadletter", r.DeadLetter, "source topic", max_message_mb=64)

CATALOGUE: tuple[TopicSpec, ...] = (
    PROMPTS, TRAJECTORIES, LOGPROBS, ROUTING, TEACHER_LOGPROBS, GROUPS, DROPPED, METRICS,
    WEIGHT_VERSIONS, WEIGHTS_APPLIED, EVAL_RESULTS, DEADLETTER,
)


def by_name(name: str) -> TopicSpec:
    for spec in CATALOGUE:
        if spec.name == name:
            return spec
    raise KeyError(f"unknown topic {name!r}; known: {[s.name for s in CATALOGUE]}")
