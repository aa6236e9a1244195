"""``milestream fork --from RUN --step N --run-dir NEW [--set ...] [--steps K]``: train a run again from its step N,
on its logged groups, under other trainer knobs. Nothing is generated and no broker is started.

  start     the original's state at step N: its newest checkpoint at or before N, then the logged steps between
            trained again under the original's own knobs (observe/recompute.py, as ``replay --step`` does)
  batches   the groups the original's lineage trained after step N (log/lineage.py), in its order, cut into
            batches of the fork's ``trainer.batch_groups``; K of them (default: as many as there are)
  steps     the learner under the fork's knobs; the optimizer keeps its moments and takes the fork's
            ``trainer.lr`` and ``weight_decay``
  output    NEW is a run folder of its own: config.yaml, checkpoints (version = step, so ``milestream export``
            reads them), ``fork.json`` (where it came from, the knobs it changed, the wall time of its steps
            beside the original's), and RUN_DIR/archive holding its step records on ``buffer.metrics`` and
            the checksums of each version's weights on ``weights.versions``: so ``plot``, ``compare`` and
            ``track --from-archive`` read a fork as any run; ``summary.json``, steps.jsonl and the plots

A fork is off-policy with respect to its own weights once it has changed any knob: its samples came from the
original's versions. Each step records the staleness it trains at (its version minus the oldest logged version of
a group's tokens, as the trainer counts it), the importance ratios its loss sees against the logged log-probs
(the loss's figures: ``is_weight_mean``, ``kl_rollout_train``, ...) and ``fork_foreign_token_frac``, the share of
its trained tokens sampled by versions after step N, weights this fork never held.

With no knob changed a fork repeats the original's steps after N bit for bit on the local backend (loss, grad
norm, the weights' checksums), so whatever a fork shows differently comes from the knobs it changed. Knobs that
shape what was generated (model, data, reward, rollout, buffer, distill, ...) are refused, each named.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from milestream.config import Config, UserError, knob_values
from milestream.infra.kafka import RawMessage
from milestream.log.archive import (ArchiveState, archive_dir, archive_row, load_manifest, write_atomically,
                                   write_segment)
from milestream.log.audit import archived_lineage
from milestream.log.lineage import Lineage
from milestream.log.reader import ArchiveSource
from milestream.log.samples import logged_manifests, logged_samples
from milestream.observe.feed import archived
from milestream.observe.plots import write_plots
from milestream.observe.recompute import checkpoint_learner, train_logged
from milestream.observe.report import write_report
from milestream.observe.series import RunSeries
from milestream.schemas import topics
from milestream.schemas.codec import Position, encode, headers_for
from milestream.schemas.records import EvalResult, GroupSample, Metrics, Record, WeightVersion
from milestream.streams.groups import staleness
from milestream.streams.weights.base import checksums
from milestream.streams.weights.disk import nbytes
from milestream.train import checkpoint
from milestream.train.learner import CollectedGroup, Learner

log = logging.getLogger(__name__)

FORK_FILE = "fork.json"
# sections whose knobs a fork may change: the trainer's, and where and how the fork is watched
FREE_SECTIONS = ("trainer", "observe", "eval", "broker", "redis")
# knobs a fork sets itself, or cannot honour although they are the trainer's
FIXED = {
    "run.run_dir": "",  # the fork's folder: --run-dir
    "trainer.steps": "give --steps (the fork's own steps after N)",
    "trainer.backend": "a fork trains on the local backend, in its own process",
    "trainer.ranks": "a fork trains on the local backend, in its own process",
}
GENERATION_SECTIONS = ("model", "data", "reward", "rollout", "buffer", "distill", "sandbox", "sessions", "router",
                       "weights")


class EvaluateWeights(Protocol):
    """The held-out evaluation of a fork's version, [] for a version not due (evaluate/evaluation.py
    ``HeldOutOfWeights``)."""

    def __call__(self, version: int, step: int, tensors: Mapping[str, Tensor], last: bool) -> list[EvalResult]: ...


class ForkError(UserError, ValueError):
    """A fork that cannot be made as asked: a knob it cannot honour, a step the log lacks, a folder in use."""


def refused_knobs(original: Config, fork: Config) -> dict[str, str]:
    """The knobs ``fork`` sets differently from ``original`` that a fork cannot honour, each with why."""
    before, after = knob_values(original.model_dump(mode="json")), knob_values(fork.model_dump(mode="json"))
    refused = {}
    for knob in sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)):
        section = knob.split(".")[0]
        if knob in FIXED:
            if FIXED[knob]:
                refused[knob] = FIXED[knob]
        elif section in GENERATION_SECTIONS:
            refused[knob] = "it shapes what was generated, and a fork trains on the logged samples"
        elif section not in FREE_SECTIONS:
            refused[knob] = "a fork only trains: nothing of it reads this knob"
    if (original.trainer.advantage_estimator == "ppo") != (fork.trainer.advantage_estimator == "ppo"):
        refused["trainer.advantage_estimator"] = "ppo's value head is in the checkpoints of ppo runs only"
    return refused


def changed_knobs(original: Config, fork: Config) -> dict[str, list[Any]]:
    """knob -> [the original's value, the fork's] of every knob the fork changed (its folder aside)."""
    before, after = knob_values(original.model_dump(mode="json")), knob_values(fork.model_dump(mode="json"))
    return {k: [before.get(k), after.get(k)] for k in sorted(before.keys() | after.keys())
            if before.get(k) != after.get(k) and k not in FIXED}


def fork_batches(steps: dict[int, Metrics], step: int, batch_groups: int, count: int | None) -> list[list[str]]:
    """The groups the lineage ``steps`` trained after ``step``, in order, in batches of ``batch_groups``
    (a last short one left out); the first ``count`` batches (None: all)."""
    later = [g for s in sorted(steps) if s > step for g in steps[s].group_ids]
    batches = [later[i:i + batch_groups] for i in range(0, len(later) - batch_groups + 1, batch_groups)]
    if not batches or count is not None and count > len(batches):
        raise ForkError(f"{'--steps ' + str(count) if count else 'a fork'}: the log holds {len(later)} groups trained "
                        f"after step {step}, {len(batches)} batches of {batch_groups}")
    return batches if count is None else batches[:count]


class ForkLog:
    """The fork's own log, RUN_DIR/archive as the archiver lays it out (log/archive.py), written here as each
    step ends: one partition per topic, the original's manifest under the fork's topic prefix."""

    def __init__(self, run_dir: Path, origin: Path, prefix: str):
        self.root, self.prefix, self.state = archive_dir(run_dir), prefix, ArchiveState()
        self.root.mkdir(parents=True)
        manifest = {**load_manifest(origin), "topic_prefix": prefix}
        write_atomically(self.root / "manifest.json", json.dumps(manifest, indent=1).encode())

    def append(self, spec: topics.TopicSpec, record: Record, key: str) -> Position:
        name = spec.name
        offset = self.state.offsets.setdefault(name, {}).get(0, 0)
        number = self.state.segments.get(name, 0)
        message = RawMessage(self.prefix + name, 0, offset, round(time.time() * 1000), 1, key.encode(),
                             headers_for(spec.record), encode([record]))
        write_segment(self.root, name, number, [archive_row(message)])
        self.state.offsets[name][0], self.state.segments[name] = offset + 1, number + 1
        write_atomically(self.root / "state.json", self.state.to_json())
        return Position(name, 0, offset)


@dataclass(frozen=True)
class Fork:
    origin: Path
    step: int  # the original's step it starts from
    batches: list[list[str]]  # the group ids of each of its steps


def fork_run(original: Config, fork: Config, origin: str | Path, step: int, count: int | None = None,
             evaluate: EvaluateWeights | None = None) -> dict:
    """Make the fork of ``origin`` (configured ``original``) at ``step`` in ``fork.run.run_dir``, its due versions
    evaluated by ``evaluate``; its summary."""
    started = time.monotonic()
    refused = refused_knobs(original, fork)
    if refused:
        raise ForkError("a fork cannot change " + "; ".join(f"{k} ({why})" for k, why in refused.items()))
    origin = Path(origin)
    lineage = archived_lineage(origin)
    last = max(lineage.steps, default=0)
    if not 0 <= step < last:
        raise ForkError(f"--step {step}: {origin} logged steps 1..{last}; a fork starts at 0..{last - 1}")
    plan = Fork(origin, step, fork_batches(lineage.steps, step, fork.trainer.batch_groups, count))
    run_dir = fork.run_path
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ForkError(f"{run_dir} is not empty: a fork is made in a new folder")
    fork = fork.with_overrides(trainer={"steps": step + len(plan.batches)})
    source = ArchiveSource(origin)
    at, learner = checkpoint_learner(original, origin, lineage.steps, step + 1)
    replayed = [lineage.steps[s] for s in range(at + 1, step + 1)]
    samples = logged_samples(source, {g for r in replayed for g in r.group_ids} | {g for b in plan.batches for g in b})
    for record in replayed:
        train_logged(learner, record, samples)
    learner = _under_knobs(learner, original, fork)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(fork.to_yaml())
    out = ForkLog(run_dir, origin, fork.broker.topic_prefix)
    ours, evals = _train(fork, learner, plan, samples, logged_manifests(source), out, evaluate)
    facts = _write_facts(run_dir, original, fork, plan, lineage, ours, at)
    trainer_knobs = [knob for knob in facts["changed"] if knob.startswith("trainer.")]
    if trainer_knobs and facts["steps_equal_to_original"] == facts["steps"]:
        log.warning("every step of the fork equals the original's (loss and gradient norm, bit for bit): %s changed "
                    "nothing on these steps (clipping, for one, never acts with trainer.updates_per_batch 1, where "
                    "pi / pi_old is 1)", ", ".join(trainer_knobs))
    summary = write_report(run_dir, ours, time.monotonic() - started, evals=evals, eval_name=fork.eval.name)
    write_plots(RunSeries().observe_all(archived(run_dir)), run_dir / "plots")
    return summary


def _under_knobs(learner: Learner, original: Config, fork: Config) -> Learner:
    """``learner`` when the fork keeps the original's trainer knobs, else a learner under the fork's in its state."""
    if original.trainer.model_copy(update={"steps": 0}) == fork.trainer.model_copy(update={"steps": 0}):
        return learner
    state = learner.state_dict()
    hyper = {"lr": fork.trainer.lr, "weight_decay": fork.trainer.weight_decay}
    state["optimizer"]["param_groups"] = [{**group, **hyper} for group in state["optimizer"]["param_groups"]]
    with torch.random.fork_rng(devices=[]):  # loading a model draws nothing from the RNG the steps go on with
        forked = Learner(fork.with_overrides(trainer={"backend": "local"}))
    forked.load_state_dict(state)
    return forked


def _train(cfg: Config, learner: Learner, plan: Fork, samples: dict[str, list[GroupSample]],
           manifests: dict, out: ForkLog, evaluate: EvaluateWeights | None) -> tuple[Lineage, list[EvalResult]]:
    """The fork's steps, each recorded on its log as the trainer records its own, and the due versions
    evaluated on the held-out prompts (the fork's training reward is the logged samples', the same as the
    original's: its held-out score is what tells the knobs' effect); the fork's lineage and results."""
    lineage, trained, evals = Lineage(), set(), []
    for step, group_ids in enumerate(plan.batches, start=plan.step + 1):
        began = time.monotonic()
        lags = [staleness(manifests[g], step - 1) for g in group_ids]  # at version step - 1, as the trainer does
        batch = [CollectedGroup(g, samples[g], lag) for g, lag in zip(group_ids, lags)]
        figures = learner.train_step(batch)
        exported = learner.export_weights()
        names, sums = checksums(exported)
        out.append(topics.WEIGHT_VERSIONS, WeightVersion(step, step, -1, "fork", "", names, sums, nbytes(exported),
                                                         time.time()), "trainer")
        values = {**figures, "step_s": time.monotonic() - began, "version": float(step),
                  "staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
                  "fork_foreign_token_frac": _foreign_share(batch, plan.step)}
        record = Metrics("trainer", step, time.time(), values, list(group_ids), lags)
        lineage.observe(record, out.append(topics.METRICS, record, "trainer"))
        trained.update(group_ids)
        if evaluate is not None:
            for result in evaluate(step, step, exported, step == cfg.trainer.steps):
                out.append(topics.EVAL_RESULTS, result, "evaluator")
                evals.append(result)
        log.info("fork step %d: loss %.4f grad norm %.4f reward %.3f staleness %.2f", step, figures["loss"],
                 figures["grad_norm"], figures["reward_mean"], values["staleness_mean"])
        if step % cfg.trainer.checkpoint_every == 0 or step == cfg.trainer.steps:
            checkpoint.save(cfg.run_path, checkpoint.TrainerState(step, step, {}, set(trained)), learner.state_dict(),
                            keep=cfg.trainer.keep_checkpoints)
    return lineage, evals


def _foreign_share(batch: Sequence[CollectedGroup], step: int) -> float:
    """The share of the batch's trained tokens sampled by versions after ``step``: weights the fork never held."""
    versions = [v for g in batch for s in g.samples for v, m in zip(s.token_versions, s.loss_mask) if m]
    return sum(v > step for v in versions) / max(len(versions), 1)


def _write_facts(run_dir: Path, original: Config, fork: Config, plan: Fork, lineage: Lineage, ours: Lineage,
                 checkpoint_step: int) -> dict[str, Any]:
    """fork.json: where the fork came from, what it changed, how many of its steps the change left equal to the
    original's, and its steps' wall time beside the original's; the facts."""
    last = plan.step + len(plan.batches)
    theirs = [lineage.steps[s] for s in range(plan.step + 1, last + 1) if s in lineage.steps]
    facts = {
        "from": str(plan.origin.resolve()), "step": plan.step, "steps": len(plan.batches),
        "started_from_checkpoint": checkpoint_step, "changed": changed_knobs(original, fork),
        "steps_equal_to_original": sum(_equal_step(lineage.steps.get(m.step), m) for m in ours.trainer_steps()),
        "step_s": sum(m.values.get("step_s", 0.0) for m in ours.trainer_steps()),
        "original_step_s": sum(m.values.get("step_s", 0.0) for m in theirs),
        # the original's steps took this long on the clock, waiting for rollout included (from step N's record)
        "original_wall_s": theirs[-1].ts - lineage.steps[plan.step].ts if plan.step in lineage.steps else None,
    }
    (run_dir / FORK_FILE).write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _equal_step(theirs: Metrics | None, ours: Metrics) -> bool:
    """The fork's step trained the original's groups to the same loss and gradient norm, bit for bit."""
    return theirs is not None and theirs.group_ids == ours.group_ids and all(
        theirs.values.get(name) == ours.values.get(name) for name in ("loss", "grad_norm"))
