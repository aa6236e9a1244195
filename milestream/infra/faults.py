"""Hold points: named places where a test stops a stage by construction, not by hoping for timing.

Off unless MILESTREAM_HOLD_DIR names a directory; then, in every process that inherits it, ``hold``
looks there for an arm file at each pass of its point:

  DIR/POINT           armed; its text N (1 when empty) means: hold at the N-th pass that sees it armed
  DIR/POINT.held.PID  the process PID took the hold (renamed from the arm file, so only one takes it)
                      and blocks the calling thread until this file is deleted or the process killed

  DIR/POINT.fail      ``fail(POINT)`` raises InjectedFault for as long as this file exists

A held asyncio stage blocks its whole event loop, like SIGSTOP but at a known point. The points:

  worker.sample_published     a rollout worker, after sending one sample of a group
  processor.took              a stream processor, a batch of records taken, before its complete groups leave
  processor.delivered         a stream processor, groups' manifests or drops delivered, before it settles them
  engine.stepped              the CpuEngine's thread, between two steps (no lock held)
  trainer.collected           the trainer, with its batch taken, before the step
  trainer.published           the trainer, the step's weights and metrics sent, before its checkpoint
  trainer.checkpoint_written  the checkpoint written to its temporary folder, not yet the latest
  archiver.flushing           the archiver, rows read and due to be written, before their segment (what a
                              broker lost while it holds is lost to the archive too)
  loader.publishing           the prompt feeder, connected, before it publishes its first prompt
  tracker.opening             the tracker stage, told how to stop, before it opens its stores (seconds of start-up)
  tracker.committing          an experiment tracker that wrote points, made them durable in its store, before
                              it saves its position

and the failure points:

  engine.step                 the CpuEngine, at the start of a step (every row of the step fails)
  worker.admitting            a rollout worker, asking the ledger to admit a prompt
"""
from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

HOLD_DIR = "MILESTREAM_HOLD_DIR"
_passes_armed: Counter[str] = Counter()


def hold(point: str) -> None:
    directory = os.environ.get(HOLD_DIR)
    if not directory:
        return
    arm = Path(directory, point)
    try:
        text = arm.read_text().strip()
    except FileNotFoundError:
        _passes_armed.pop(point, None)  # a later arm counts its passes afresh
        return
    _passes_armed[point] += 1
    if _passes_armed[point] < (int(text) if text else 1):
        return
    held = arm.with_name(f"{point}.held.{os.getpid()}")
    try:
        arm.rename(held)
    except FileNotFoundError:  # another process took this hold
        return
    _passes_armed.pop(point, None)
    while held.exists():
        time.sleep(0.05)


class InjectedFault(RuntimeError):
    """A failure a test asked for (``DIR/POINT.fail``)."""


def fail(point: str) -> None:
    directory = os.environ.get(HOLD_DIR)
    if directory and Path(directory, f"{point}.fail").exists():
        raise InjectedFault(f"injected fault at {point}")
