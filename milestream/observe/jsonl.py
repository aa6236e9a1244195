"""A JSONL log of ``buffer.metrics``: one line per record, as the stages published it.

    {"offset": 41, "source": "trainer", "step": 12, "version": 12, "ts": 1760000000.1, "values": {...}}

``version`` is the weight version the source reports (the trainer's ``version``, the processor's
``latest_version``, a rollout worker's ``engine_version``; null for a source without one). The
offset makes the log resumable: a writer started again on the same file (the metrics stage of
``milestream run`` restarts with its run) repairs a torn last line and writes only the records
after the last offset in it, so each record is in the file once.

A JSONL line per record loads into pandas (``pd.read_json(path, lines=True)``) or any dashboard;
TensorBoard, W&B and MLflow have writers of their own (observe/track.py).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from milestream.observe.feed import Observed
from milestream.schemas import topics
from milestream.schemas.records import Metrics

log = logging.getLogger(__name__)

VERSION_FIELDS = ("version", "latest_version", "engine_version")


def log_line(offset: int, record: Metrics) -> str:
    version = next((record.values[name] for name in VERSION_FIELDS if name in record.values), None)
    return json.dumps({"offset": offset, "source": record.source, "step": record.step,
                       "version": None if version is None else int(version), "ts": record.ts,
                       "values": record.values})


class JsonlWriter:
    """An observer that appends each ``buffer.metrics`` record past the file's last offset."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.resume_from = self._repair()
        self.out = open(self.path, "a")
        self.written = 0

    def _repair(self) -> int:
        """Cut a torn last line (a writer killed mid-line); the offset after the file's last line."""
        if not self.path.exists():
            return 0
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            log.warning("%s: dropping a torn last line of %d bytes", self.path, len(data) - whole)
            with open(self.path, "r+b") as out:
                out.truncate(whole)
        lines = data[:whole].splitlines()
        if not lines:
            return 0
        try:
            return int(json.loads(lines[-1])["offset"]) + 1
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}: line {len(lines)} is not a metrics log line ({exc}); "
                             "write to another file") from None

    def observe(self, item: Observed) -> None:
        if item.spec is not topics.METRICS or item.position.offset < self.resume_from:
            return
        self.out.write(log_line(item.position.offset, item.record) + "\n")
        self.out.flush()  # a reader tailing the file sees each record as it lands
        self.written += 1

    def close(self) -> None:
        self.out.close()
