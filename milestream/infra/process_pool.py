"""Calls run in worker processes that a timeout ends for real: a process that overruns is killed and
replaced, so nothing it computes goes on eating a core (a thread cannot be stopped, and CPU-bound Python
in one holds the GIL for as long as it runs).

The processes fork from multiprocessing's fork server, started once per caller and preloaded with the
modules named, never from the caller itself, whose threads (librdkafka, torch, aiohttp) a plain fork
would copy mid-lock. A process serves one call at a time: it gets the argument, calls the function that
``build`` made (once, when the process started), runs a coroutine it returns on the process's own event
loop, and sends the result back. The caller waits for the answer on its event loop, never blocking it.
A process dies with the caller: an idle one when its pipe closes, a busy one by SIGIO when it does
(``_ends_with_the_caller``); at the caller's normal exit, multiprocessing terminates them (daemons).
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import inspect
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

# a hang guard on a process's start (the fork server's first start imports the preloaded modules, and
# ``build`` may import a user's module); a call's own limit is the pool's timeout_s
START_TIMEOUT_S = 120.0


class ProcessFailed(RuntimeError):
    """The call's process died, or could not start; the message says how."""


@dataclass(frozen=True)
class _Failure:
    """What a process sends back for an exception of ``build`` or of the call (its type and message)."""

    text: str


@dataclass(frozen=True)
class _Worker:
    process: BaseProcess
    conn: Connection

    def end(self) -> None:
        self.process.kill()
        self.conn.close()


class ProcessPool:
    """At most ``size`` processes, started when calls need them; ``await pool(argument)`` is the result of
    the built function on it. A call that outlasts ``timeout_s`` raises asyncio.TimeoutError (its process
    killed), one whose process dies raises ProcessFailed, an exception in the call raises ProcessFailed
    with its text. ``build`` and the arguments and results must pickle."""

    def __init__(self, build: Callable[[], Callable[[Any], Any]], size: int, timeout_s: float,
                 preload: Sequence[str] = ()) -> None:
        self.build, self.size, self.timeout_s = build, size, timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(list(preload))
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None  # made on first use, in the caller's event loop

    async def __call__(self, argument: Any) -> Any:
        self._slots = self._slots or asyncio.Semaphore(self.size)
        async with self._slots:
            worker = self._idle_alive() or await self._start()
            try:
                worker.conn.send(argument)
                answer = await _answer(worker, self.timeout_s)
            except BaseException:  # timed out, died or cancelled: its answer would be the next call's
                worker.end()
                raise
            self._idle.append(worker)
        if isinstance(answer, _Failure):
            raise ProcessFailed(answer.text)
        return answer

    def _idle_alive(self) -> _Worker | None:
        """An idle process, if one is left that nothing killed meanwhile (the OOM killer, an operator)."""
        while self._idle:
            worker = self._idle.pop()
            if worker.process.is_alive():
                return worker
            worker.end()
        return None

    async def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(theirs, self.build), daemon=True,
                                        name="milestream-pool")
        await asyncio.to_thread(process.start)  # the fork server's first start takes seconds
        theirs.close()
        worker = _Worker(process, ours)
        try:
            ready = await _answer(worker, START_TIMEOUT_S)
        except asyncio.TimeoutError:
            worker.end()
            raise ProcessFailed(f"the process did not start within {START_TIMEOUT_S:g} s") from None
        except BaseException:
            worker.end()
            raise
        if isinstance(ready, _Failure):
            worker.end()
            raise ProcessFailed(f"the process could not start: {ready.text}")
        return worker


async def _answer(worker: _Worker, timeout_s: float) -> Any:
    """The process's next message, awaited on the event loop (its pipe watched, no thread held)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    fd = worker.conn.fileno()
    loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
    try:
        await asyncio.wait_for(readable, timeout_s)
    finally:
        loop.remove_reader(fd)
    try:
        return worker.conn.recv()
    except (EOFError, OSError):
        await asyncio.to_thread(worker.process.join, 5.0)
        raise ProcessFailed(f"its process ended (exit code {worker.process.exitcode})") from None


def _serve(conn: Connection, build: Callable[[], Callable[[Any], Any]]) -> None:
    """A pool process: build the function, say so, then answer calls until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the caller's to handle
    signal.signal(signal.SIGIO, signal.SIG_DFL)  # its default action ends the process (_ends_with_the_caller)
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    loop = asyncio.new_event_loop()
    try:
        with _ends_with_the_caller(conn):
            function = build()
    except BaseException as exc:
        conn.send(_Failure(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(None)
    while True:
        try:
            argument = conn.recv()
        except EOFError:  # the caller closed the pool or died
            return
        try:
            with _ends_with_the_caller(conn):
                result = function(argument)
                while inspect.isawaitable(result):
                    result = loop.run_until_complete(_awaited(result))
            conn.send(result)
        except Exception as exc:  # the call's, or its result's pickling: this call's failure, not the process's
            conn.send(_Failure(f"{type(exc).__name__}: {exc}"))


@contextlib.contextmanager
def _ends_with_the_caller(conn: Connection) -> Iterator[None]:
    """While the process computes, the caller sends nothing: its end of the pipe turning readable means it
    closed it (the caller died). The kernel then sends SIGIO, whose default action ends this process however
    busy it is, a C loop holding the GIL included. (The fork server cannot take it along: every process it
    forks holds a copy of the end of the pipe that tells the server its caller is gone.)"""
    fd = conn.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
    try:
        if conn.poll(0):  # closed before it was armed
            os._exit(1)
        yield
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
