"""How every stage is told to stop: SIGTERM (its supervisor's ``terminate``) or SIGINT (a user's Ctrl-C).

A stage takes the signals first thing, before its set-up (a model loaded, stores opened, a broker asked
for its topics: seconds to minutes), so a stage told to stop while it starts stops in order at its first
look at ``stop``, saving what it must, rather than dying by the default action mid-way. A second signal
ends it at once: a set-up waiting on a broker or Redis that is gone never looks at ``stop``, and whoever
sent the signal twice wants it gone (the supervisor sends SIGKILL after its grace anyway).
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _told(stop: threading.Event, signum: int) -> None:
    if stop.is_set():
        os._exit(128 + signum)
    stop.set()


def stop_on_signals() -> threading.Event:
    """The stage's stop, set by the first SIGTERM or SIGINT."""
    stop = threading.Event()
    for sig in SIGNALS:
        signal.signal(sig, lambda signum, _frame: _told(stop, signum))
    return stop


def async_stop(stop: threading.Event) -> asyncio.Event:
    """Called in the stage's running event loop: ``stop`` as an asyncio.Event (set already when a signal came
    during the set-up). The loop takes the signals from here on: a plain handler would run only when its
    selector next wakes."""
    loop, event = asyncio.get_running_loop(), asyncio.Event()

    def told(signum: int) -> None:
        _told(stop, signum)
        event.set()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, told, sig)
    if stop.is_set():
        event.set()
    return event
