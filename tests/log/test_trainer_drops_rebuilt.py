"""The trainer's drops, decided once (streams/ledger.py): the first stands, and a ledger rebuilt after a lost Redis
has them back from the log, so a trainer resumed on it still drops, never trains, what a dead life dropped."""
from __future__ import annotations

from milestream.log.accounting import SOURCES, LoggedRun, rebuild_ledger
from milestream.streams.ledger import SETTLED, BufferLedger, TrainerDrop
from milestream.train.checkpoint import TrainerState


def test_the_first_drop_of_a_group_by_the_trainer_stands(cfg):
    ledger = BufferLedger(cfg)
    assert ledger.drop_for_good("g#0", TrainerDrop("stale", 4)) == TrainerDrop("stale", 4)
    # a later life at an older version would not drop it as stale; were it to drop it otherwise, the first stands
    assert ledger.drop_for_good("g#0", TrainerDrop("invalid", -1)) == TrainerDrop("stale", 4)
    ledger.begin_sending("g#0")
    assert ledger.sent(["g#0", "h#0"]) == ({"g#0"}, {"g#0": TrainerDrop("stale", 4)})


def test_a_rebuilt_ledger_has_the_trainers_drops_on_the_log_and_no_others(cfg):
    groups = ("stale#0", "filtered#0")
    drops = {"stale#0": {"group_id": "stale#0", "reason": "stale", "dropped_by": "trainer", "trainer_version": 4},
             "filtered#0": {"group_id": "filtered#0", "reason": "filtered", "dropped_by": "processor",
                            "trainer_version": 2}}
    run = LoggedRun({g: (0, i) for i, g in enumerate(groups)}, 2,
                    {spec.name: [(0, i, g) for i, g in enumerate(groups)] for spec in SOURCES},
                    [(0, 0, "stale#0", 1)], drops, TrainerState(step=2, version=2), announced=2)
    ledger = BufferLedger(cfg)
    ledger.drop_for_good("gone#0", TrainerDrop("stale", 9))  # of a ledger the log knows nothing of
    rebuild_ledger(cfg, run, {0: 2})
    assert ledger.sent(["stale#0", "filtered#0", "gone#0"]) == (set(groups), {"stale#0": TrainerDrop("stale", 4)})
    assert ledger.settlement("stale#0") == SETTLED and ledger.balance()["unaccounted"] == 0
