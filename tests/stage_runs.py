"""Stages run from a test: ``milestream run`` showing its logs when it fails (any stage logs: print_log_tails),
or in a thread the test watches; a rollout worker run until a condition holds, and the groups it published."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from milestream.infra.kafka import Admin, RecordConsumer, end_offset
from milestream.orchestrator import run_loop
from milestream.producers.worker import RolloutWorker


def print_log_tails(log_dir: Path, lines: int = 40) -> None:
    """The last ``lines`` of every stage log in ``log_dir`` (pytest shows them with a failure)."""
    for log in sorted(log_dir.glob("*.log")):
        print(f"==== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))


def run_showing_logs(cfg) -> dict:
    """run_loop's summary; on failure, the tail of each stage's log."""
    try:
        return run_loop(cfg)
    except BaseException:
        print_log_tails(Path(cfg.run.run_dir) / "logs")
        raise


def published_groups(consumer: RecordConsumer, seen: dict[str, list]) -> dict[str, list]:
    for delivery in consumer.drain(idle_s=0.5, max_wait_s=5):
        for record in delivery.records:
            seen.setdefault(record.group_id, []).append(record)
    return seen


async def run_until(worker: RolloutWorker, condition, timeout: float = 120.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(condition) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    stop.set()
    await task


def running(runner: threading.Thread, what: str):
    """A check for waits: raises once the run has ended, as what it waits for will then never come."""
    def check() -> None:
        if not runner.is_alive():
            raise AssertionError(f"the run ended while waiting for {what}")
    return check


def wait_for(condition, timeout_s: float, what: str, runner: threading.Thread) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        running(runner, what)()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.3)


def start_run(cfg) -> tuple[threading.Thread, dict]:
    """``run_loop`` in a thread; the outcome dict gets its summary, or the error it raised."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["summary"] = run_loop(cfg)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, outcome


def print_logs_unless_done(run_dir: Path, outcome: dict) -> None:
    if "summary" not in outcome:
        print_log_tails(run_dir / "logs")


def end_offsets(cfg, specs) -> dict[str, list[int]]:
    """The broker's end offset of every partition of each of ``specs`` of the run: what a stage wrote, if anything."""
    ends = {}
    for spec in specs:
        partitions = Admin(cfg.broker).partitions(spec)
        consumer = RecordConsumer(cfg.broker, spec, f"{cfg.broker.topic_prefix}end-offsets").assign(partitions=partitions)
        try:
            ends[spec.name] = [end_offset(consumer, p) for p in partitions]
        finally:
            consumer.close()
    return ends
