"""``milestream replay --step N``: recompute a logged trainer step and compare it bit for bit.

The batch of step N is rebuilt from the log: its record on ``buffer.metrics`` (the lineage's, see
log/lineage.py) names its groups in order, and ``buffer.groups`` holds their manifests, whose records
the rollout topics hold (log/samples.py). The learner starts
from the newest checkpoint before step N, trains the logged batches of the steps in between, then
takes step N and compares its loss and gradient norm with the logged ones. Arithmetic on one CPU
thread is deterministic, so on the backend the run used (``local``) they match exactly.
``replay_steps`` does the same for a range of steps, from any log source (``milestream replay
--redrive trainer --steps A:B``, observe/redrive.py).
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from milestream.config import Config, UserError
from milestream.train import checkpoint
from milestream.log.lineage import lineage_of
from milestream.log.reader import ArchiveSource, read_archive
from milestream.log.samples import logged_samples
from milestream.train.learner import CollectedGroup, Learner
from milestream.infra.model import configure_process
from milestream.schemas import topics
from milestream.schemas.records import GroupSample, Metrics

COMPARED = ("loss", "grad_norm")
GroupFetcher = Callable[[set[str]], dict[str, list[GroupSample]]]  # group ids -> their logged samples


class StepReplayError(UserError, RuntimeError):
    """The log or the checkpoints cannot rebuild the step."""


@dataclass(frozen=True)
class StepReplay:
    step: int
    from_checkpoint: int  # the step whose checkpoint the replay started from
    logged: dict[str, float]
    replayed: dict[str, float]

    @property
    def bitwise_equal(self) -> bool:
        return all(_bits(self.logged[k]) == _bits(self.replayed[k]) for k in COMPARED)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def checkpoint_before(run_dir: Path, step: int) -> tuple[int, dict]:
    """The newest checkpoint of a step before ``step`` (0: the initial weights, no checkpoint)."""
    earlier = [(at, folder) for at, folder in checkpoint.saved(run_dir).items() if at < step]
    if not earlier:
        return 0, {}
    at, folder = earlier[-1]
    return at, checkpoint.load(folder)


def logged_groups(run_dir: Path, wanted: set[str]) -> dict[str, list[GroupSample]]:
    return logged_samples(ArchiveSource(run_dir), wanted)


def replay_step(cfg: Config, run_dir: str | Path, step: int) -> StepReplay:
    steps = lineage_of(read_archive(run_dir, topics.METRICS)).steps
    return replay_steps(cfg, run_dir, steps, functools.partial(logged_groups, Path(run_dir)), step, step)[0]


def replay_steps(cfg: Config, run_dir: str | Path, steps: dict[int, Metrics], fetch_groups: GroupFetcher,
                 first: int, last: int) -> list[StepReplay]:
    """Steps ``first``..``last`` of the lineage ``steps``, recomputed from the checkpoint before ``first``."""
    run_dir = Path(run_dir)
    absent = [s for s in range(first, last + 1) if s not in steps]
    if absent:
        raise StepReplayError(f"steps {absent} are not on the log of {run_dir} (steps {min(steps, default=0)}"
                              f"..{max(steps, default=0)})")
    at, learner = checkpoint_learner(cfg, run_dir, steps, first)
    records: list[Metrics] = [steps[s] for s in range(at + 1, last + 1)]
    groups = fetch_groups({g for r in records for g in r.group_ids})
    replayed = []
    for record in records:
        figures = train_logged(learner, record, groups)
        if record.step >= first:
            replayed.append(StepReplay(record.step, at, {k: record.values[k] for k in COMPARED},
                                       {k: figures[k] for k in COMPARED}))
    return replayed


def checkpoint_learner(cfg: Config, run_dir: Path, steps: dict[int, Metrics], first: int) -> tuple[int, Learner]:
    """A local learner in the state of the newest checkpoint before step ``first`` (the RNG as it was saved), and
    that checkpoint's step; StepReplayError unless the lineage ``steps`` holds every step from it to ``first``."""
    at, payload = checkpoint_before(run_dir, first)
    missing = [s for s in range(at + 1, first) if s not in steps]
    if missing:
        raise StepReplayError(f"no record of steps {missing} to replay from the checkpoint of step {at}")
    configure_process(cfg.model)
    learner = Learner(cfg.with_overrides(trainer={"backend": "local"}))
    if payload:
        learner.load_state_dict(payload["backend"])
        checkpoint.restore(payload)
    return at, learner


def train_logged(learner: Learner, record: Metrics, groups: dict[str, list[GroupSample]]) -> dict[str, float]:
    """One logged step again: the groups its record names, in its order, at its logged staleness."""
    absent_groups = [g for g in record.group_ids if g not in groups]
    if absent_groups:
        raise StepReplayError(f"step {record.step}: groups {absent_groups[:3]} are not on the logged buffer.groups")
    lags = record.group_staleness or [0] * len(record.group_ids)
    return learner.train_step([CollectedGroup(g, groups[g], lag) for g, lag in zip(record.group_ids, lags)])
