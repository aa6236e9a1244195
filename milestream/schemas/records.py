"""Record types of every topic: a frozen dataclass and the Arrow schema it travels in.

Each record type carries a schema name and version; the codec writes both into the Arrow schema
metadata and a Kafka header, and refuses a value whose version it does not know.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

I32_LIST = pa.list_(pa.int32())
F32_LIST = pa.list_(pa.float32())
STR_LIST = pa.list_(pa.string())


class Record:
    """Base of all topic records: ``SCHEMA`` matches the dataclass fields one to one."""

    SCHEMA: ClassVar[pa.Schema]
    VERSION: ClassVar[int] = 1
    COMPRESSED: ClassVar[bool] = False  # its bytes are compressed already: the codec sends them as they are

    @classmethod
    def schema_id(cls) -> str:
        return f"{cls.__name__}/{cls.VERSION}"

    def to_row(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Record":
        return cls(**row)


def _checked(cls: type[Record]) -> type[Record]:
    names = [f.name for f in dataclasses.fields(cls)]
    if names != cls.SCHEMA.names:
        raise TypeError(f"{cls.__name__}: dataclass fields {names} differ from schema {cls.SCHEMA.names}")
    return cls


@_checked
@dataclass(frozen=True)
class Prompt(Record):
    prompt_id: str
    dataset: str
    index: int
    question: str
    answer: str
    entry_json: str  # the task entry its verifier needs
    attempt: int = 0  # 0, or n for the n-th retry of a prompt whose group went unused
    SCHEMA: ClassVar = pa.schema([
        ("prompt_id", pa.string()), ("dataset", pa.string()), ("index", pa.int64()),
        ("question", pa.string()), ("answer", pa.string()), ("entry_json", pa.string()), ("attempt", pa.int32()),
    ])

    @property
    def group_id(self) -> str:
        return f"{self.prompt_id}#{self.attempt}"


TRAJECTORY_FIELDS = [
    ("trajectory_id", pa.string()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("sample_index", pa.int32()), ("group_size", pa.int32()),
    ("prompt_ids", I32_LIST), ("response_ids", I32_LIST), ("loss_mask", pa.list_(pa.int8())),
    ("token_versions", I32_LIST), ("reward", pa.float32()), ("status", pa.string()),
    ("response_text", pa.string()), ("engine_id", pa.string()), ("worker_id", pa.string()),
    ("submitted_at", pa.float64()), ("finished_at", pa.float64()), ("routing_chunks", pa.int32()),
    ("reward_error", pa.string()), ("error", pa.string()), ("leaf", pa.int32()), ("leaves", pa.int32()),
]


def trajectory_id(group_id: str, sample_index: int, leaf: int = 0) -> str:
    """``GROUP/SAMPLE`` for a sample's first (or only) trajectory, ``GROUP/SAMPLE.LEAF`` for its others."""
    return f"{group_id}/{sample_index}" if leaf == 0 else f"{group_id}/{sample_index}.{leaf}"


def leaf_of(trajectory_id_: str, group_id: str, sample_index: int) -> int | None:
    """The leaf a trajectory id names, or None when it is no trajectory of that group's sample."""
    stem = f"{group_id}/{sample_index}"
    if trajectory_id_ == stem:
        return 0
    rest = trajectory_id_.removeprefix(stem + ".")
    if rest == trajectory_id_ or not rest.isdecimal() or not rest.isascii() or rest[0] == "0":
        return None
    return int(rest)


def episode_mean(samples) -> float:
    """The mean reward of samples counting each episode once (an agent's episode may be several
    trajectories, ``leaves``, each carrying its reward); 0.0 for none."""
    weights = [1.0 / max(sample.leaves, 1) for sample in samples]
    return sum(w * s.reward for w, s in zip(weights, samples)) / sum(weights) if weights else 0.0


@_checked
@dataclass(frozen=True)
class Trajectory(Record):
    trajectory_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    token_versions: list[int]  # weight version that produced each response token
    reward: float
    status: str  # completed | truncated | aborted | error
    response_text: str
    engine_id: str
    worker_id: str
    submitted_at: float
    finished_at: float
    routing_chunks: int = 0  # Routing records that belong to it on rollout.routing (0: none recorded)
    reward_error: str = ""  # why the reward failed (its group is dropped, reason reward_error); "" when it did not
    error: str = ""  # status error: why the sample failed (engine, generate or rollout function); dropped as error
    # an agent's episode may be several trajectories (its session's leaves: branches, conversations), each
    # carrying the episode's reward; the trajectory id names the leaf (``trajectory_id``)
    leaf: int = 0
    leaves: int = 1
    SCHEMA: ClassVar = pa.schema(TRAJECTORY_FIELDS)
    VERSION: ClassVar = 4  # 2: reward_error; 3: error; 4: leaf, leaves
    STATUSES: ClassVar = ("completed", "truncated", "aborted", "error")


@_checked
@dataclass(frozen=True)
class LogProbs(Record):
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    logprobs: list[float]  # behaviour log-prob of each response token
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    SCHEMA: ClassVar = pa.schema([
        ("trajectory_id", pa.string()), ("group_id", pa.string()), ("sample_index", pa.int32()),
        ("group_size", pa.int32()), ("logprobs", F32_LIST),
        ("topk_ids", pa.list_(I32_LIST)), ("topk_logprobs", pa.list_(F32_LIST)),
    ])


@_checked
@dataclass(frozen=True)
class TeacherLogProbs(Record):
    """On-policy distillation: the teacher's log-prob of each response token of one trajectory, given the
    prompt and the response before it (``milestream teacher``; the student's are on rollout.logprobs)."""

    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    logprobs: list[float]
    teacher: str  # which teacher: distill.teacher_path or teacher_url
    SCHEMA: ClassVar = pa.schema([
        ("trajectory_id", pa.string()), ("group_id", pa.string()), ("sample_index", pa.int32()),
        ("group_size", pa.int32()), ("logprobs", F32_LIST), ("teacher", pa.string()),
    ])


@_checked
@dataclass(frozen=True)
class Routing(Record):
    """MoE routing replay (R3): expert ids [tokens x layers x k], narrow ints, compressed, chunked."""

    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    chunk_index: int
    num_chunks: int
    num_tokens: int
    num_layers: int
    top_k: int
    id_bytes: int  # width of one expert id: 1 or 2
    compression: str
    data: bytes
    SCHEMA: ClassVar = pa.schema([
        ("trajectory_id", pa.string()), ("group_id", pa.string()), ("sample_index", pa.int32()),
        ("group_size", pa.int32()), ("chunk_index", pa.int32()), ("num_chunks", pa.int32()),
        ("num_tokens", pa.int32()), ("num_layers", pa.int32()), ("top_k", pa.int32()),
        ("id_bytes", pa.int8()), ("compression", pa.string()), ("data", pa.binary()),
    ])
    COMPRESSED: ClassVar = True


@_checked
@dataclass(frozen=True)
class GroupSample(Trajectory):
    """One sample of a group as the trainer trains on it: a trajectory with its log-probs and routing, joined
    from the records a ``GroupManifest`` points at (``streams.groups.join_sample``).

    The routing chunks stay as they came (compressed); ``schemas.routing.expert_ids`` unpacks them.
    """

    logprobs: list[float] = field(default_factory=list)
    routing_layout: list[int] = field(default_factory=list)  # [tokens, layers, top_k, id_bytes]; [] when none
    routing_compression: str = ""
    routing_data: list[bytes] = field(default_factory=list)  # chunks in order
    teacher_logprobs: list[float] = field(default_factory=list)  # on-policy distillation (distill); [] when off
    SCHEMA: ClassVar = pa.schema(TRAJECTORY_FIELDS + [
        ("logprobs", F32_LIST), ("routing_layout", I32_LIST), ("routing_compression", pa.string()),
        ("routing_data", pa.list_(pa.binary())), ("teacher_logprobs", F32_LIST),
    ])


@_checked
@dataclass(frozen=True)
class GroupManifest(Record):
    """One sample of a group on ``buffer.groups``: the fields the drop rules, the data selector and the audit
    read, and where its records lie on the rollout topics, which the trainer reads them from.

    So a group of any size is one small message, and the processor never copies a payload. Every record of a
    sample (and of its group) is keyed by the group id, so they share one partition number; each ``*_row``
    is the record's index in its value (a value may carry several records).
    """

    trajectory_id: str
    group_id: str
    prompt_id: str
    sample_index: int
    group_size: int
    reward: float
    status: str
    engine_id: str
    worker_id: str
    submitted_at: float
    finished_at: float
    prompt_tokens: int
    response_tokens: int
    min_version: int  # the oldest weight version of its response tokens; -1 when it has none
    max_version: int
    partition: int
    trajectory_offset: int
    trajectory_row: int
    logprobs_offset: int
    logprobs_row: int
    routing_offsets: list[int]  # on rollout.routing, its chunks in order; [] when its engine recorded none
    routing_rows: list[int]
    teacher_offset: int = -1  # on rollout.teacher_logprobs under on-policy distillation; -1 when off
    teacher_row: int = -1
    leaf: int = 0  # which of its sample's ``leaves`` trajectories (Trajectory.leaf)
    leaves: int = 1
    SCHEMA: ClassVar = pa.schema([
        ("trajectory_id", pa.string()), ("group_id", pa.string()), ("prompt_id", pa.string()),
        ("sample_index", pa.int32()), ("group_size", pa.int32()), ("reward", pa.float32()), ("status", pa.string()),
        ("engine_id", pa.string()), ("worker_id", pa.string()), ("submitted_at", pa.float64()),
        ("finished_at", pa.float64()), ("prompt_tokens", pa.int32()), ("response_tokens", pa.int32()),
        ("min_version", pa.int32()), ("max_version", pa.int32()), ("partition", pa.int32()),
        ("trajectory_offset", pa.int64()), ("trajectory_row", pa.int32()), ("logprobs_offset", pa.int64()),
        ("logprobs_row", pa.int32()), ("routing_offsets", pa.list_(pa.int64())), ("routing_rows", I32_LIST),
        ("teacher_offset", pa.int64()), ("teacher_row", pa.int32()), ("leaf", pa.int32()), ("leaves", pa.int32()),
    ])
    VERSION: ClassVar = 2  # 2: leaf, leaves


@_checked
@dataclass(frozen=True)
class Dropped(Record):
    group_id: str
    prompt_id: str
    reason: str  # aborted | reward_error | filtered | stale | incomplete
    detail: str
    dropped_by: str
    num_samples: int
    min_version: int
    trainer_version: int
    mean_reward: float
    ts: float
    SCHEMA: ClassVar = pa.schema([
        ("group_id", pa.string()), ("prompt_id", pa.string()), ("reason", pa.string()),
        ("detail", pa.string()), ("dropped_by", pa.string()), ("num_samples", pa.int32()),
        ("min_version", pa.int32()), ("trainer_version", pa.int32()), ("mean_reward", pa.float32()),
        ("ts", pa.float64()),
    ])
    REASONS: ClassVar = ("aborted", "reward_error", "filtered", "stale", "incomplete")


@_checked
@dataclass(frozen=True)
class Metrics(Record):
    source: str  # processor | trainer | rollout
    step: int
    ts: float
    values: dict[str, float]
    group_ids: list[str] = field(default_factory=list)  # trainer: the groups of this step
    group_staleness: list[int] = field(default_factory=list)
    SCHEMA: ClassVar = pa.schema([
        ("source", pa.string()), ("step", pa.int64()), ("ts", pa.float64()),
        ("values", pa.map_(pa.string(), pa.float64())), ("group_ids", STR_LIST),
        ("group_staleness", I32_LIST),
    ])

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Metrics":
        return cls(**{**row, "values": dict(row["values"])})


@_checked
@dataclass(frozen=True)
class WeightVersion(Record):
    version: int
    step: int
    base_version: int
    transport: str  # disk | disk-delta | broadcast | p2p
    location: str
    tensor_names: list[str]
    checksums: list[str]  # xxh64 of each tensor's bytes, in tensor_names order
    num_bytes: int
    ts: float
    SCHEMA: ClassVar = pa.schema([
        ("version", pa.int64()), ("step", pa.int64()), ("base_version", pa.int64()),
        ("transport", pa.string()), ("location", pa.string()), ("tensor_names", STR_LIST),
        ("checksums", STR_LIST), ("num_bytes", pa.int64()), ("ts", pa.float64()),
    ])


@_checked
@dataclass(frozen=True)
class WeightApplied(Record):
    engine_id: str
    version: int
    tensor_names: list[str]
    checksums: list[str]
    ok: bool
    detail: str
    ts: float
    SCHEMA: ClassVar = pa.schema([
        ("engine_id", pa.string()), ("version", pa.int64()), ("tensor_names", STR_LIST),
        ("checksums", STR_LIST), ("ok", pa.bool_()), ("detail", pa.string()), ("ts", pa.float64()),
    ])


@_checked
@dataclass(frozen=True)
class EvalResult(Record):
    name: str
    version: int
    step: int
    score: float
    lag_steps: int
    status: str  # ok | skipped
    detail: str
    ts: float
    SCHEMA: ClassVar = pa.schema([
        ("name", pa.string()), ("version", pa.int64()), ("step", pa.int64()), ("score", pa.float64()),
        ("lag_steps", pa.int64()), ("status", pa.string()), ("detail", pa.string()), ("ts", pa.float64()),
    ])


@_checked
@dataclass(frozen=True)
class DeadLetter(Record):
    source_topic: str
    partition: int
    offset: int
    error: str
    field: str
    key: bytes | None
    value: bytes | None
    ts: float
    SCHEMA: ClassVar = pa.schema([
        ("source_topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()),
        ("error", pa.string()), ("field", pa.string()), ("key", pa.binary()), ("value", pa.binary()),
        ("ts", pa.float64()),
    ])
