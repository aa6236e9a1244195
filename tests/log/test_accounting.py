"""The buffer ledger's figures as the log tells them, for a run resumed after its broker or Redis was lost."""
from __future__ import annotations

from dataclasses import replace

from milestream.log.accounting import SOURCES, LoggedRun, derive_accounting
from milestream.streams.ledger import ADMITTED, READMITTED, BufferLedger
from milestream.train.checkpoint import TrainerState


def logged_run(checkpoint_version: int, announced: int) -> LoggedRun:
    """A run of one emitted group the trainer has not read, its trainer checkpointed at ``checkpoint_version``
    and ``announced`` the newest version on weights.versions."""
    trainer = TrainerState(step=checkpoint_version, version=checkpoint_version)
    sources = {spec.name: [(0, 0, "g#0")] for spec in SOURCES}
    return LoggedRun({"g#0": (0, 0)}, 1, sources, [(0, 0, "g#0", 1)], {}, trainer, announced)


def test_the_trainer_version_is_the_newest_the_log_or_the_checkpoint_tells(cfg):
    # a trainer that raised 4 in the ledger and died announcing it: the log ends at 3, the resumed trainer redoes 4
    run = logged_run(checkpoint_version=3, announced=3)
    assert run.trainer_version == 3
    assert replace(run, announced=4).trainer_version == 4  # announced, then killed before its checkpoint
    assert logged_run(checkpoint_version=5, announced=3).trainer_version == 5  # the archive behind the checkpoint
    figures = derive_accounting(cfg, run, {0: 1}, prompts_published=1)
    assert (figures.credit, figures.queued, figures.trainer_version) == (cfg.buffer_capacity - 1, {"g#0": 1}, 3)
    ledger = BufferLedger(cfg)
    ledger.raise_trainer_version(4)
    ledger.reconcile(figures.reconciled())
    assert ledger.trainer_version() == 3 and ledger.queued_versions() == [1]
    assert ledger.balance()["unaccounted"] == 0


def test_a_group_whose_admission_a_crash_rolled_back_keeps_its_credit_and_its_records(cfg):
    """A broker crash lost rollout's committed offset past prompt 1, whose group g1#0 had published its samples:
    its prompt is read again, yet its records on the log are the run's, not strangers' (no dead letter). The
    group holds its credit as an admitted one, the worker finds it readmitted, the processor takes its
    records; prompt 2, with none on the log, is admitted afresh."""
    trainer = TrainerState()
    sources = {spec.name: [(0, 1, "g1#0")] for spec in SOURCES}
    run = LoggedRun({"g0#0": (0, 0), "g1#0": (0, 1), "g2#0": (0, 2)}, 3, sources, [], {}, trainer, 0)
    figures = derive_accounting(cfg, run, {0: 1}, prompts_published=3)  # rollout committed up to prompt 1
    assert (figures.credit, figures.in_flight, figures.prompts_admitted) == (cfg.buffer_capacity - 1, ("g1#0",), 2)
    ledger = BufferLedger(cfg)
    ledger.reconcile(figures.reconciled())
    assert ledger.recall(["g1#0", "g2#0"]) == {"g1#0": (None, True), "g2#0": (None, False)}
    assert ledger.admit("g1#0", "w", 0) == READMITTED and ledger.admit("g2#0", "w", 0) == ADMITTED
    assert ledger.prompts_admitted() == 3 and ledger.balance()["unaccounted"] == 0
