"""The prompts of a run: its sources (``data.sources``, ``data.path`` or the reasoning-gym task), read,
mapped, shuffled and interleaved into one deterministic stream.

A file source is JSONL, Parquet, or a folder written by ``datasets``' ``save_to_disk`` (its Arrow files
are read with pyarrow); its columns are mapped by ``prompt_key`` (plain text or chat messages),
``label_key`` and ``metadata_keys``. Each epoch visits a source's rows in an order drawn from
``data.seed``, the source's name and the epoch (``data.shuffle``); a reasoning-gym source is procedural
and visits its entries in index order. Several sources are interleaved by weight (smooth weighted
round robin), so the stream is a function of the configuration alone and a position in it (the prompt
feeder's committed count) says exactly what comes next.

A prompt's id is ``<source>-s<seed>-e<epoch>-<row>`` (for the demo: ``chain_sum-s42-e0-17``), so a
retried group's prompt is rebuilt from its id. Held out by question: with evaluation on and no
``eval.path``, the held-out questions are the first distinct ones past the task's ``size`` entries,
and training skips every entry that asks one of them.
"""
from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import count, islice
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from milestream.config import Config, DataConfig, SourceConfig, UserError
from milestream.producers.tasks import TaskPrompt, iter_prompts
from milestream.schemas.records import Prompt

DRAWS_PER_PROMPT = 50  # held-out entries drawn per wanted distinct question before giving up


class DataError(UserError, ValueError):
    """Bad user data; the message names the file and the line, row or column."""


@dataclass(frozen=True)
class Row:
    """One row of a file source, mapped: a prompt (text or chat messages), its label and metadata."""

    prompt: str | tuple[dict[str, Any], ...]
    label: str | None
    metadata: dict[str, Any]
    where: str  # "file.jsonl line 3", for errors about this row

    @property
    def text(self) -> str:
        """The prompt as text: a chat prompt's last user message."""
        if isinstance(self.prompt, str):
            return self.prompt
        return next((str(m.get("content", "")) for m in reversed(self.prompt) if m.get("role") == "user"), "")


# ---- reading files ----------------------------------------------------------------------------------

def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every row of a JSONL file, a Parquet file or a datasets folder."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.is_dir():
        return _datasets_folder(path)
    if path.suffix in (".jsonl", ".json"):
        return _jsonl(path)
    if path.suffix == ".parquet":
        return [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    raise DataError(f"data file {path}: not .jsonl, .json, .parquet or a datasets folder")


def _jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number}: a {type(row).__name__}, not a JSON object")
            rows.append((f"{path} line {number}", row))
    return rows


def _datasets_folder(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """A ``Dataset.save_to_disk`` folder: ``state.json`` lists its Arrow (IPC stream) files."""
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{path} holds several splits {splits}: name one, e.g. {path / (splits or ['train'])[0]}")
    state = path / "state.json"
    if not state.exists():
        raise DataError(f"{path}: a folder, but no state.json of a datasets save_to_disk")
    files = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    tables = []
    for file in files:
        try:
            with pa.memory_map(str(file)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"{file}: not an Arrow file of a datasets folder: {exc}") from None
    rows = [row for table in tables for row in table.to_pylist()]
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


@dataclass(frozen=True)
class Columns:
    """The column mapping of a file source."""

    prompt: str
    label: str | None
    metadata: tuple[str, ...]

    @classmethod
    def of(cls, source: SourceConfig, data: DataConfig) -> "Columns":
        return cls(source.prompt_key or data.prompt_key, source.label_key or data.label_key,
                   source.metadata_keys if source.metadata_keys is not None else data.metadata_keys)


def map_rows(path: str, columns: Columns) -> list[Row]:
    """The file's rows with the column mapping applied; a missing column or an empty file is an error."""
    raw = read_rows(path)
    if not raw:
        raise DataError(f"data file {path} has no rows")
    wanted = [columns.prompt, *([columns.label] if columns.label else []), *columns.metadata]
    rows = []
    for where, row in raw:
        missing = [key for key in wanted if key not in row]
        if missing:
            raise DataError(f"{where}: no column {missing[0]!r} (columns: {sorted(row)})")
        label = row[columns.label] if columns.label else None
        rows.append(Row(_prompt(row[columns.prompt], where, columns.prompt), None if label is None else str(label),
                        {key: row[key] for key in columns.metadata}, where))
    return rows


def _prompt(value: Any, where: str, key: str) -> str | tuple[dict[str, Any], ...]:
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and value
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)):
        return tuple(value)
    raise DataError(f"{where}: column {key!r} is neither text nor a list of chat messages {{role, content}}")


# ---- sources ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """One source of prompts: file rows, or reasoning-gym entries (``task_data``)."""

    name: str
    weight: float
    seed: int
    shuffle: bool
    rows: tuple[Row, ...] = ()
    task_data: DataConfig | None = None  # the task's DataConfig: its entries and its verifier
    skipped: frozenset[str] = frozenset()  # task questions held out for evaluation

    @property
    def size(self) -> int:
        return self.task_data.size if self.task_data is not None else len(self.rows)

    def order(self, epoch: int) -> list[int]:
        rows = list(range(self.size))
        if self.shuffle and self.task_data is None:
            random.Random(f"{self.seed}/{self.name}/{epoch}").shuffle(rows)
        return rows

    def prompt(self, epoch: int, row: int) -> Prompt:
        prompt_id = f"{self.name}-s{self.seed}-e{epoch}-{row}"
        if self.task_data is not None:
            (entry,) = iter_prompts(self.task_data, start=row, stop=row + 1)
            return Prompt(prompt_id, self.name, row, entry.question, entry.answer, json.dumps(entry.entry))
        mapped = self.rows[row]
        body = {"label": mapped.label, "metadata": mapped.metadata}
        body["prompt" if isinstance(mapped.prompt, str) else "messages"] = mapped.prompt
        return Prompt(prompt_id, self.name, row, mapped.text, mapped.label or "", json.dumps(body))

    def stream(self, epochs: int | None) -> Iterator[Prompt]:
        for epoch in count() if epochs is None else range(epochs):
            for row in self.order(epoch):
                prompt = self.prompt(epoch, row)
                if prompt.question not in self.skipped:
                    yield prompt


def sources(cfg: Config) -> tuple[Source, ...]:
    """The configured sources, their files read and mapped once per process (and file version)."""
    versions = [_version(source.path) for source in cfg.data.data_sources() if source.path]
    return _sources(json.dumps({"data": cfg.data.model_dump(mode="json"), "eval": cfg.eval.model_dump(mode="json")}),
                    tuple(versions))


def _version(path: str) -> tuple[int, int]:
    try:
        stat = Path(path).stat()
    except OSError:
        return (0, 0)  # reading it says what is wrong
    return (stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _sources(data_and_eval: str, file_versions: tuple[tuple[int, int], ...]) -> tuple[Source, ...]:
    cfg = Config.model_validate(json.loads(data_and_eval))
    built = []
    for source in cfg.data.data_sources():
        common = {"weight": source.weight, "seed": cfg.data.seed, "shuffle": cfg.data.shuffle}
        if source.task is not None:
            skipped = held_out_questions(cfg) if source.task == held_out_task(cfg) else frozenset()
            built.append(Source(source.name or source.task, task_data=task_data(cfg.data, source),
                                skipped=skipped, **common))
        else:
            rows = tuple(map_rows(source.path, Columns.of(source, cfg.data)))
            built.append(Source(source.name or Path(source.path).name.split(".")[0], rows=rows, **common))
    names = [s.name for s in built]
    if len(set(names)) != len(names):
        raise DataError(f"data.sources: names {names} repeat; give each source a distinct name")
    return tuple(built)


def task_data(data: DataConfig, source: SourceConfig) -> DataConfig:
    """The DataConfig of one reasoning-gym source: what its entries and its verifier read."""
    return data.model_copy(update={"task": source.task, "task_options": source.task_options, "size": source.size,
                                   "sources": (), "path": None})


def source_named(cfg: Config, name: str) -> Source:
    for source in sources(cfg):
        if source.name == name:
            return source
    raise ValueError(f"prompt source {name!r} is not one of this configuration's data sources")


def prompt_stream(cfg: Config, position: int = 0) -> Iterator[Prompt]:
    """The run's prompts from ``position`` on; it ends after ``data.epochs`` passes over every source."""
    return islice(_interleaved(sources(cfg), cfg.data.epochs), position, None)


def _interleaved(all_sources: Sequence[Source], epochs: int | None) -> Iterator[Prompt]:
    """Smooth weighted round robin: each turn every source gains its weight and the richest one gives."""
    streams = {source.name: source.stream(epochs) for source in all_sources}
    weights = {source.name: source.weight for source in all_sources}
    credit = dict.fromkeys(streams, 0.0)
    while streams:
        for name in streams:
            credit[name] += weights[name]
        name = max(streams, key=lambda n: credit[n])
        credit[name] -= sum(weights[n] for n in streams)
        try:
            yield next(streams[name])
        except StopIteration:
            del streams[name], credit[name]


# ---- prompts as the policy and the reward see them ---------------------------------------------------

def prompt_messages(cfg: Config, prompt: Prompt) -> list[dict[str, Any]]:
    """The chat messages of a prompt: its own, or its text as the user turn; ``data.system_prompt`` first
    unless it is empty or the messages bring their own."""
    body = json.loads(prompt.entry_json)
    messages = list(body.get("messages") or [{"role": "user", "content": prompt.question}])
    if cfg.data.system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": cfg.data.system_prompt})
    return messages


def reward_inputs(cfg: Config, prompt: Prompt) -> tuple[str | None, dict[str, Any]]:
    """(label, metadata) of a prompt: for a task, its answer and its whole entry."""
    body = json.loads(prompt.entry_json)
    if source_named(cfg, prompt.dataset).task_data is not None:
        return prompt.answer, body
    return body.get("label"), body.get("metadata") or {}


# ---- held-out prompts --------------------------------------------------------------------------------

def held_out_task(cfg: Config) -> str | None:
    """The task whose questions evaluation holds out (the first task source), when evaluation is on
    and has no file of its own."""
    if cfg.eval.mode is None or cfg.eval.path:
        return None
    return next((s.task for s in cfg.data.data_sources() if s.task), None)


def held_out(cfg: Config) -> list[TaskPrompt]:
    """``eval.num_prompts`` distinct held-out questions: the rows of ``eval.path``, or task entries past
    the training entries whose questions training skips."""
    wanted = cfg.eval.num_prompts
    if cfg.eval.path:
        rows = map_rows(cfg.eval.path, Columns.of(SourceConfig(path=cfg.eval.path), cfg.data))[:wanted]
        chat = [{} if isinstance(row.prompt, str) else {"messages": list(row.prompt)} for row in rows]
        return [TaskPrompt(i, row.text, row.label or "", {"question": row.text, "answer": row.label or "",
                                                           "metadata": row.metadata, **messages})
                for i, (row, messages) in enumerate(zip(rows, chat))]
    return list(_held_out_entries(cfg))


def held_out_questions(cfg: Config) -> frozenset[str]:
    return frozenset(p.question for p in _held_out_entries(cfg))


def _held_out_entries(cfg: Config) -> tuple[TaskPrompt, ...]:
    task = next((s for s in cfg.data.data_sources() if s.task), None)
    if task is None:
        raise DataError("evaluation of a data set without a reasoning-gym task needs eval.path, a held-out file")
    return _distinct_entries(task_data(cfg.data, task).model_dump_json(), cfg.eval.num_prompts)


@functools.lru_cache(maxsize=8)
def _distinct_entries(task_json: str, wanted: int) -> tuple[TaskPrompt, ...]:
    task = DataConfig.model_validate_json(task_json)
    beyond_training = task.model_copy(update={"size": task.size + DRAWS_PER_PROMPT * wanted})
    by_question: dict[str, TaskPrompt] = {}
    for prompt in iter_prompts(beyond_training, start=task.size):
        by_question.setdefault(prompt.question, prompt)
        if len(by_question) == wanted:
            return tuple(by_question.values())
    raise ValueError(f"eval.num_prompts={wanted}: data.task {task.task!r} gave only {len(by_question)} "
                     f"distinct questions in {DRAWS_PER_PROMPT * wanted} held-out entries")
