"""The buffer ledger's invariant on a real redis-server: credit available + groups held = capacity.

A model of the groups (admitted, being sent, taken early, queued, gone) runs alongside the ledger
through random interleavings of what the workers, the processor and the trainer do, duplicates
included (a prompt redone after its worker died, a restarted processor re-settles, a restarted trainer
re-takes)."""
from __future__ import annotations

import collections
import itertools
import random

import pytest

from milestream.streams.ledger import (ADMITTED, BEHIND, COMPLETE, EMITTED, NO_CREDIT, READMITTED, SENDING, SETTLED,
                                       BufferLedger, Reconciled)

# held outside the queue: in rollout, in the processor, or both
HOLDING = ("admitted", "sending", "early")


class Model:
    def __init__(self, ledger: BufferLedger, rng: random.Random):
        self.ledger, self.rng = ledger, rng
        self.state: dict[str, str] = {}
        self.ids = itertools.count()
        self.moves: collections.Counter[str] = collections.Counter()

    def pick(self, *states: str) -> str | None:
        candidates = sorted(g for g, s in self.state.items() if s in states)
        return self.rng.choice(candidates) if candidates else None

    def count(self, *states: str) -> int:
        return sum(s in states for s in self.state.values())

    def admit(self) -> None:
        group = f"g{next(self.ids)}#0"
        has_credit = self.ledger.capacity - self.count(*HOLDING, "queued") > 0
        assert self.ledger.admit(group, "w", 0) == (ADMITTED if has_credit else NO_CREDIT)
        if has_credit:
            self.state[group] = "admitted"

    def redo(self, group: str) -> None:
        """Its worker died: another admits the prompt again, with the credit it holds."""
        assert self.ledger.admit(group, "w2", 0) == READMITTED

    def redo_complete(self, group: str) -> None:
        """A redone prompt whose group the processor already has is passed over."""
        assert self.ledger.admit(group, "w2", 0) == COMPLETE

    def begin_sending(self, group: str) -> None:
        before = self.ledger.begin_sending(group).before
        assert before == (None if self.state[group] == "admitted" else SENDING)
        if self.state[group] == "admitted":
            self.state[group] = "sending"

    def settle_emitted(self, group: str) -> None:
        self.settle(group, EMITTED)

    def settle_dropped(self, group: str) -> None:
        self.settle(group, self.rng.choice(["aborted", "incomplete"]))

    def settle(self, group: str, outcome: str) -> None:
        assert self.ledger.settle(group, outcome, self.rng.randrange(5))
        emitted_waiting = outcome == EMITTED and self.state[group] == "sending"
        self.state[group] = "queued" if emitted_waiting else "gone"

    def settle_again(self, group: str) -> None:
        assert not self.ledger.settle(group, self.rng.choice([EMITTED, "aborted"]), 1)
        assert self.ledger.begin_sending(group).before == SETTLED

    def trainer_takes(self, group: str) -> None:
        assert self.ledger.leave(group)
        self.state[group] = "gone" if self.state[group] == "queued" else "early"

    def trainer_takes_again(self, group: str) -> None:
        assert not self.ledger.leave(group)

    def step(self) -> None:
        moves = [(self.admit, ()), (self.redo, ("admitted",)), (self.redo_complete, ("sending", "queued", "gone")),
                 (self.begin_sending, ("admitted", "sending")), (self.settle_emitted, ("sending", "early")),
                 (self.settle_dropped, ("sending", "early")), (self.settle_again, ("queued", "gone")),
                 (self.trainer_takes, ("queued", "sending")), (self.trainer_takes_again, ("early", "gone"))]
        move, states = self.rng.choice(moves)
        if not states:
            move()
        elif (group := self.pick(*states)) is not None:
            move(group)
        else:
            return
        self.moves[move.__name__] += 1

    def check(self) -> None:
        available, queued = self.ledger.available(), self.ledger.queued()
        assert available >= 0 and queued == self.count("queued")
        assert available + queued + self.count(*HOLDING) == self.ledger.capacity
        assert self.ledger.balance()["unaccounted"] == 0  # what the end of a run reports
        assert self.ledger.in_flight().keys() == {g for g, s in self.state.items() if s in HOLDING}


@pytest.mark.parametrize("seed", range(4))
def test_credit_plus_groups_held_is_the_capacity_after_every_operation(cfg, seed):
    model = Model(BufferLedger(cfg), random.Random(seed))
    for _ in range(600):
        model.step()
        model.check()
    assert len(model.moves) == 9 and min(model.moves.values()) >= 5, model.moves  # every move, several times


def test_initialise_keeps_the_credit_of_a_running_buffer(cfg):
    ledger = BufferLedger(cfg)
    assert ledger.available() == ledger.capacity and ledger.admit("g#0", "w", 0) == ADMITTED
    ledger.initialise()  # a restarted stage
    assert ledger.available() == ledger.capacity - 1


def test_reconcile_rewrites_credit_queue_admissions_and_forgets_unsettled_groups(cfg):
    ledger = BufferLedger(cfg)
    for group in ("early#0", "redo#0"):
        ledger.begin_sending(group)
    ledger.leave("early#0")  # taken early before the broker was lost
    ledger.admit("lost#0", "w", 0)  # admitted in the lost broker's run: the log says nothing of it
    ledger.raise_trainer_version(5)  # raised by a trainer killed before it announced 5: the log ends at 4
    ledger.reconcile(Reconciled(credit=3, queue={"q#0": 2}, prompts_admitted=7, unsettled=("redo#0",),
                                admitted=("f#0",), trainer_version=4))
    assert ledger.trainer_version() == 4
    assert ledger.available() == 3 and ledger.queued_versions() == [2] and ledger.prompts_admitted() == 7
    assert ledger.in_flight() == {"f#0": "restored"} and ledger.admit("f#0", "w", 4) == READMITTED
    assert ledger.settlement("redo#0") is None and ledger.settlement("early#0") == SENDING
    assert ledger.leave("early#0")  # its early take was forgotten: the resumed trainer takes it again
    assert ledger.leave("q#0") and ledger.available() == 4


def test_rebuild_writes_every_key_of_a_fresh_ledger(cfg):
    ledger = BufferLedger(cfg)
    assert ledger.capacity == 4
    ledger.rebuild(Reconciled(credit=2, queue={"q#0": 1}, prompts_admitted=3, admitted=("f#0",), trainer_version=7),
                   settled=["q#0", "gone#0"], totals={"groups_out": 1, "dropped_filtered": 1}, prompts_published=5)
    assert ledger.available() == 2 and ledger.queued_versions() == [1] and ledger.prompts_admitted() == 3
    assert ledger.trainer_version() == 7
    assert ledger.prompts_published() == 5 and ledger.run_totals() == {"groups_out": 1, "dropped_filtered": 1}
    assert ledger.settlement("gone#0") == SETTLED and not ledger.settle("gone#0", "filtered")  # a re-read: nothing
    assert ledger.in_flight() == {"f#0": "restored"} and ledger.admit("gone#0", "w", 0) == "complete"
    assert ledger.balance()["unaccounted"] == 0  # 2 available + 1 queued + 1 in flight = 4


def test_an_engine_older_than_the_version_floor_admits_nothing_and_the_floor_never_goes_down(cfg):
    ledger = BufferLedger(cfg)
    assert ledger.admit("a#0", "w", 0) == ADMITTED
    assert ledger.raise_floor(3) == 3 and ledger.raise_floor(1) == 3  # a trainer resumed at version 1
    assert ledger.admit("b#0", "w", 2) == BEHIND  # no credit taken
    assert ledger.admit("a#0", "w2", 2) == BEHIND  # nor a redo on an engine as old
    assert ledger.available() == ledger.capacity - 1 and ledger.version_floor() == 3
    assert ledger.admit("b#0", "w", 3) == ADMITTED and ledger.admit("a#0", "w2", 4) == READMITTED
    assert ledger.balance()["unaccounted"] == 0


def test_async_admits_no_group_that_would_be_past_the_staleness_bound_when_the_trainer_collects_it(cfg):
    ledger = BufferLedger(cfg)  # async: capacity 4 groups, batches of 2, staleness bound 2
    ledger.raise_trainer_version(3)
    # the trainer, at 3, collects the next 2 groups at version 4 and the 2 after them at 5 (at the latest)
    assert ledger.admit("a#0", "w", 2) == ADMITTED and ledger.admit("b#0", "w", 2) == ADMITTED  # at 4: lag 2
    assert ledger.admit("c#0", "w", 2) == BEHIND and ledger.available() == 2  # at 5: lag 3; no credit taken
    assert ledger.admit("c#0", "w", 3) == ADMITTED and ledger.balance()["unaccounted"] == 0
    one_step = BufferLedger(cfg.with_overrides(run={"schedule": "one_step"}))  # its floor decides, not this
    assert one_step.admit("d#0", "w", 0) == ADMITTED
