"""Where the experiment trackers write: TensorBoard event files, a W&B run (offline by default), an MLflow run.

Each sink writes a *row* (every figure of one trainer step) and an *evaluation* (one score at the step of
the version it scored) as one unit its store keeps whole or not at all: a TensorBoard event (its record
carries a checksum; a torn one is skipped by the reader), a W&B history record, an MLflow ``log_batch``
(one transaction in a SQL store). ``written`` reads the store back: the last trainer step it holds and,
per evaluation, the last step scored. That is what makes a writer killed after writing, before saving its
position, write nothing twice (observe/track.py). ``commit`` makes what was written durable.

The libraries are the ``trackers`` extra (``pip install -e '.[trackers]'``); each is imported only by the
sink that needs it, when a writer is switched on.
"""
from __future__ import annotations

import json
import os
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

FLUSH_TIMEOUT_S = 120.0  # a hang guard: W&B's service writes a finished run's log in well under a second
TRAIN_PREFIXES = ("trainer", "processor", "rollout", "verifier", "dropped", "weights")  # every row key's first part


@dataclass
class Written:
    """What a store holds already: the last trainer step, the last step of each evaluation, and whether it
    has the run's hyper-parameters."""

    step: int = 0
    evals: dict[str, int] = field(default_factory=dict)
    params: bool = False

    def covers(self, other: "Written") -> bool:
        return self.step >= other.step and all(self.evals.get(n, -1) >= s for n, s in other.evals.items())


class Sink(Protocol):
    name: str

    def written(self) -> Written: ...
    def hyperparameters(self, params: dict[str, Any]) -> None: ...
    def row(self, step: int, ts: float, values: dict[str, float]) -> None: ...
    def evaluation(self, name: str, step: int, ts: float, score: float) -> None: ...
    def commit(self) -> None: ...
    def close(self) -> None: ...


def _eval_key(name: str) -> str:
    return f"eval/{name}"


class TensorBoardSink:
    """Event files under ``folder`` (a run's folder inside a TensorBoard log directory). Scalars are written
    double precision (``new_style``), so a figure reads back exactly as the stage published it."""

    name = "tensorboard"

    def __init__(self, folder: Path):
        from torch.utils.tensorboard.writer import FileWriter

        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._back = self._read_back()  # before this writer adds its own (empty) event file
        self.writer = FileWriter(str(folder))

    def _read_back(self) -> Written:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        if not any(self.folder.glob("*tfevents*")):
            return Written()
        events = EventAccumulator(str(self.folder), size_guidance={"tensors": 0})
        events.Reload()
        last = {tag: max(e.step for e in events.Tensors(tag)) for tag in events.Tags()["tensors"]}
        params = "_hparams_/experiment" in events.PluginTagToContent("hparams")
        return Written(max((s for t, s in last.items() if t.startswith("trainer/")), default=0),
                       {t.removeprefix("eval/"): s for t, s in last.items() if t.startswith("eval/")}, params)

    def written(self) -> Written:
        return self._back

    def _add(self, step: int, ts: float, values: dict[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        summary = Summary(value=[scalar(tag, value, new_style=True, double_precision=True).value[0]
                                 for tag, value in values.items()])
        self.writer.add_summary(summary, global_step=step, walltime=ts)

    def hyperparameters(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(params, {}):
            self.writer.add_summary(summary)

    def row(self, step: int, ts: float, values: dict[str, float]) -> None:
        self._add(step, ts, values)

    def evaluation(self, name: str, step: int, ts: float, score: float) -> None:
        self._add(step, ts, {_eval_key(name): score})

    def commit(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run (id: the run's key), one history row per trainer step or evaluation.

    Rows are numbered by the sink (W&B's ``_step``: the rows the run holds, read back from its transaction
    logs); the charts' x-axes are ``trainer_step`` and ``eval_step`` (``define_metric``). W&B keeps rows in
    its service's memory until the run finishes, so ``commit`` finishes the run; the next row resumes it, in
    a new segment (offline: a new ``offline-run-*`` folder; ``wandb sync`` uploads a run's segments in order).
    """

    name = "wandb"

    def __init__(self, mode: str, project: str, entity: str | None, directory: Path, run_name: str, run_key: str,
                 params: dict[str, Any]):
        self.mode, self.project, self.entity, self.directory = mode, project, entity, directory
        self.run_name, self.run_key, self.params = run_name, run_key, params
        self.directory.mkdir(parents=True, exist_ok=True)
        rows = [row for path in wandb_logs(directory, run_key) for row in wandb_rows(path)]
        self.next_row = max((int(r["_step"]) for r in rows if "_step" in r), default=-1) + 1
        self._back = Written(max((int(r["trainer_step"]) for r in rows if "trainer_step" in r), default=0), {}, True)
        for r in rows:
            for key in r:
                if key.startswith("eval/"):
                    name = key.removeprefix("eval/")
                    self._back.evals[name] = max(self._back.evals.get(name, -1), int(r["eval_step"]))
        self.run = None

    def written(self) -> Written:
        return self._back

    def _open(self):
        import wandb

        if self.run is None:
            settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False,
                                      disable_git=True, x_save_requirements=False)
            self.run = wandb.init(mode=self.mode, project=self.project, entity=self.entity, dir=str(self.directory),
                                  id=self.run_key, name=self.run_name, config=self.params, settings=settings,
                                  # offline, each segment is a run of its own that `wandb sync` joins by id
                                  resume="allow" if self.mode == "online" else None)
            self.run.define_metric("trainer_step")
            self.run.define_metric("eval_step")
            for prefix in TRAIN_PREFIXES:
                self.run.define_metric(f"{prefix}/*", step_metric="trainer_step")
            self.run.define_metric("eval/*", step_metric="eval_step")
        return self.run

    def _log(self, values: dict[str, float]) -> None:
        self._open().log(values, step=self.next_row)
        self.next_row += 1

    def hyperparameters(self, params: dict[str, Any]) -> None:
        """Given to every segment as its config (``__init__``)."""

    def row(self, step: int, ts: float, values: dict[str, float]) -> None:
        self._log({**values, "trainer_step": step})

    def evaluation(self, name: str, step: int, ts: float, score: float) -> None:
        self._log({_eval_key(name): score, "eval_step": step})

    def commit(self) -> None:
        """Finish the run and stop W&B's service (``finish`` returns before the service has closed the run:
        at once the next segment would find its id in use, and its log may still lack the last rows), then
        check that the run's transaction log holds the last row."""
        import wandb

        if self.run is None:
            return
        log_file, last = Path(self.run.settings.sync_file), self.next_row - 1
        self.run.finish()
        self.run = None
        wandb.teardown()
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while not any(row.get("_step") == last for row in wandb_rows(log_file)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"W&B's service did not write row {last} to {log_file} within {FLUSH_TIMEOUT_S} s")
            time.sleep(0.05)

    def close(self) -> None:
        self.commit()


# ---- W&B's transaction log (run-ID.wandb), read with wandb's own record types ----------------------------
# The file: a 7-byte header (":W&B", 0xBEE1, version 0), then LevelDB-style chunks in 32 KiB blocks, each
# chunk: CRC-32 of its type byte and data (4 bytes), data length (2), type (1: full, 2: first, 3: middle,
# 4: last). A record is a serialised wandb.proto Record. A chunk that is cut short or fails its checksum
# ends the read: it is where a killed service stopped writing.
_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK, _CHUNK_HEADER = 32 * 1024, 7


def wandb_logs(directory: Path, run_key: str) -> list[Path]:
    """The transaction logs of run ``run_key`` under ``directory``/wandb, oldest segment first."""
    logs = (directory / "wandb").glob(f"*run-*-{run_key}*/run-{run_key}.wandb")
    return sorted(logs, key=lambda p: os.stat(p).st_mtime)


def wandb_chunks(data: bytes) -> Iterator[bytes]:
    pos, pending = len(_HEADER), b""
    while pos + _CHUNK_HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + _CHUNK_HEADER:pos + _CHUNK_HEADER + length]
        if kind == 0 or len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += _CHUNK_HEADER + length
        if kind == 1:
            yield body
        elif kind == 2:
            pending = body
        elif kind == 3:
            pending += body
        elif kind == 4:
            yield pending + body


def wandb_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The history rows of one transaction log, each a dict of its keys' values (``_step`` included)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < len(_HEADER):  # its service has not written the header yet
        return
    if not data.startswith(_HEADER):
        raise ValueError(f"{path}: not a W&B transaction log")
    for chunk in wandb_chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            yield {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}


class MlflowSink:
    """One MLflow run per milestream run (tag ``milestream.run``: the run's key) in ``experiment``."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, run_key: str, artifacts: str | None = None):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
        runs = self.client.search_runs([experiment_id], f"tags.`milestream.run` = '{run_key}'", max_results=1)
        run = runs[0] if runs else self.client.create_run(experiment_id, run_name=run_name,
                                                          tags={"milestream.run": run_key})
        self.run_id = run.info.run_id
        self.client.update_run(self.run_id, status="RUNNING")
        self._back = self._read_back(run)

    def _read_back(self, run) -> Written:
        last = {key: max(m.step for m in self.client.get_metric_history(self.run_id, key))
                for key in run.data.metrics}
        return Written(max((s for k, s in last.items() if k.startswith("trainer/")), default=0),
                       {k.removeprefix("eval/"): s for k, s in last.items() if k.startswith("eval/")},
                       bool(run.data.params))

    def written(self) -> Written:
        return self._back

    def _metrics(self, step: int, ts: float, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, int(ts * 1000), step) for k, v in values.items()])

    def hyperparameters(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[start:start + 100])

    def row(self, step: int, ts: float, values: dict[str, float]) -> None:
        self._metrics(step, ts, values)

    def evaluation(self, name: str, step: int, ts: float, score: float) -> None:
        self._metrics(step, ts, {_eval_key(name): score})

    def commit(self) -> None:
        """Each batch is its own transaction: nothing waits."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
