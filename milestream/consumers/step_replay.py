"""``milestream replay --step N``: recompute a logged trainer step and compare it bit for bit.

The batch of step N is rebuilt from the log: its record on ``buffer.metrics`` (the lineage's, see
consumers/audit.py) names its groups in order, and ``buffer.groups`` holds them. The learner starts
from the newest checkpoint before step N, trains the logged batches of the steps in between, then
takes step N and compares its loss and gradient norm with the logged ones. Arithmetic on one CPU
thread is deterministic, so on the backend the run used (``local``) they match exactly.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from milestream.config import Config
from milestream.consumers import checkpoint
from milestream.consumers.audit import lineage
from milestream.consumers.archive import archived_messages
from milestream.consumers.learner import CollectedGroup, Learner
from milestream.infra.model import configure_process
from milestream.schemas import topics
from milestream.schemas.records import GroupSample, Metrics

COMPARED = ("loss", "grad_norm")


class StepReplayError(RuntimeError):
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
    found = sorted((int(p.name.split("_")[1]), p) for p in checkpoint.checkpoint_root(run_dir).glob("step_*")
                   if p.is_dir() and int(p.name.split("_")[1]) < step)
    if not found:
        return 0, {}
    at, folder = found[-1]
    return at, torch.load(folder / "checkpoint.pt", weights_only=False)


def logged_groups(run_dir: Path, wanted: set[str]) -> dict[str, list[GroupSample]]:
    groups: dict[str, list[GroupSample]] = {}
    for _, _, samples in archived_messages(run_dir, topics.GROUPS):
        if samples and samples[0].group_id in wanted:
            groups.setdefault(samples[0].group_id, samples)  # a re-emission carries the same group
    return groups


def replay_step(cfg: Config, run_dir: str | Path, step: int) -> StepReplay:
    run_dir = Path(run_dir)
    steps, _ = lineage(run_dir)
    if step not in steps:
        raise StepReplayError(f"step {step} is not on the archived log of {run_dir} (steps {min(steps, default=0)}"
                              f"..{max(steps, default=0)})")
    at, payload = checkpoint_before(run_dir, step)
    missing = [s for s in range(at + 1, step + 1) if s not in steps]
    if missing:
        raise StepReplayError(f"no record of steps {missing} to replay from the checkpoint of step {at}")
    configure_process(cfg.model)
    learner = Learner(cfg.with_overrides(trainer={"backend": "local"}))
    if payload:
        learner.load_state_dict(payload["backend"])
        checkpoint.restore(payload)
    records: list[Metrics] = [steps[s] for s in range(at + 1, step + 1)]
    groups = logged_groups(run_dir, {g for r in records for g in r.group_ids})
    figures: dict[str, float] = {}
    for record in records:
        absent = [g for g in record.group_ids if g not in groups]
        if absent:
            raise StepReplayError(f"step {record.step}: groups {absent[:3]} are not on the archived buffer.groups")
        figures = learner.train_step([CollectedGroup(g, groups[g], 0) for g in record.group_ids])
    logged = steps[step].values
    return StepReplay(step, at, {k: logged[k] for k in COMPARED}, {k: figures[k] for k in COMPARED})
