"""The rollout workers' place in the prompts consumer group, kept by a thread of its own."""
from __future__ import annotations

import asyncio
import queue
import threading

from milestream.infra.kafka import Delivery, RecordConsumer


class PromptReader:
    """The worker's place in the prompts consumer group, kept by one thread that alone uses the consumer and
    polls all the time, so a rebalance (a worker joining or leaving) never waits for a worker busy
    generating or out of credit, and the event loop never waits on the broker. It reads at most one prompt
    ahead of admission, and sends the offsets the worker hands it between two polls."""

    def __init__(self, consumer: RecordConsumer) -> None:
        self.consumer = consumer
        self.ready: queue.Queue[Delivery] = queue.Queue(maxsize=1)
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._to_commit: dict[int, int] = {}
        self.taken = 0  # prompts read so far
        self.thread = threading.Thread(target=self._read, name="prompt-reader", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.stopped.is_set():
            self._send_commit()
            if self.ready.full():
                self.consumer.keep_place(0.2)
            elif (delivery := self.consumer.poll(0.2)) is not None:
                self.ready.put(delivery)
                self.taken += 1

    def _send_commit(self) -> None:
        """Sent, not waited for: one that never lands costs a redo of prompts whose groups are complete,
        which admission passes over."""
        with self._lock:
            offsets, self._to_commit = self._to_commit, {}
        if offsets:
            self.consumer.commit(offsets, wait=False)

    async def next(self) -> Delivery:
        while True:
            try:
                return self.ready.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.05)

    def commit(self, offsets: dict[int, int], wait: bool = False) -> bool:
        """Handed to the reading thread, which sends it between two polls: never waited for (``wait`` is not
        honoured; the consumer is that thread's alone)."""
        with self._lock:
            self._to_commit = dict(offsets)
        return True

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._send_commit()
        self.consumer.close()
