"""The user's inputs checked before any stage starts (``milestream run``, ``milestream load-prompts``),
and each prompt a rollout worker reads (``check_prompt``): the prompts topic is anyone's to write.

Every data source and ``eval.path`` is read and mapped (a missing file or column, a malformed JSONL
line, an empty data set are errors naming file and line or column), the reward's import path is
resolved, and every file prompt must fit the context with ``rollout.max_new_tokens`` to spare. A model.path
folder of a family the run cannot serve is refused, naming what it lacks.
"""
from __future__ import annotations

import re

from milestream.config import Config
from milestream.producers.data import DataError, held_out, prompt_messages, source_named, sources
from milestream.producers.rewards import load_reward
from milestream.producers.tasks import chat_input_ids
from milestream.schemas.codec import Position, RecordError
from milestream.schemas.records import Prompt


def context_limit(cfg: Config) -> int:
    """The most tokens a prompt and its response may take (the model's own limit joins here)."""
    return cfg.rollout.max_context_tokens


def check_model(cfg: Config) -> None:
    """Raise ModelFolderError when model.path holds a model the CPU engine cannot batch (engines/engine.py
    ``unserved``) or, under rollout.true_on_policy, one exact attention cannot compute (infra/on_policy.py
    ``refusal``); the built-in models are served."""
    if not cfg.model.path:
        return
    # torch and transformers only for a model folder: the prompt feeder checks its inputs at every start
    from milestream.engines.engine import unserved
    from milestream.infra import on_policy
    from milestream.infra.model import ModelFolderError, model_config

    config = model_config(cfg.model)
    where = f"model.path {cfg.model.path} ({config.model_type})"
    if cfg.rollout.engine_url is None and (reason := unserved(config)):
        raise ModelFolderError(f"{where} {reason}")
    if cfg.rollout.true_on_policy and (reason := on_policy.refusal(config, cfg.rollout.max_context_tokens)):
        raise ModelFolderError(f"rollout.true_on_policy: {where} {reason}")


def check_inputs(cfg: Config) -> None:
    """Raise DataError (ModelFolderError for the model) naming what is wrong with the run's inputs."""
    check_model(cfg)
    all_sources = sources(cfg)
    if cfg.eval.mode is not None:
        held_out(cfg)
    try:
        load_reward(cfg)
    except ValueError as exc:  # an import path that does not resolve
        raise DataError(str(exc)) from None
    file_sources = [source for source in all_sources if source.task_data is None]
    if not file_sources:
        return
    from milestream.infra.model import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    room = context_limit(cfg) - cfg.rollout.max_new_tokens
    for source in file_sources:
        for row in range(source.size):
            prompt = source.prompt(0, row)
            length = len(chat_input_ids(tokenizer, prompt_messages(cfg, prompt), cfg.data.assistant_prefill))
            if length > room:
                raise DataError(f"{source.rows[row].where}: the prompt takes {length} tokens; with "
                                f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} it passes the context "
                                f"of {context_limit(cfg)} tokens (rollout.max_context_tokens)")


def check_prompt(cfg: Config, records: list[Prompt], position: Position) -> None:
    """Raise RecordError naming the field of a prompt the run's loader did not write: a prompt is the entry
    its data source holds at the row its id names (a retry repeats it with a higher ``attempt``), so one made
    up elsewhere (an unknown source, a question, answer or entry of its own) is never rolled out."""
    def bad(field: str, reason: str) -> RecordError:
        return RecordError(position, field, reason)

    if len(records) != 1:
        raise bad("<value>", f"{len(records)} prompts in one message; the loader writes one")
    (prompt,) = records
    try:
        source = source_named(cfg, prompt.dataset)
    except ValueError as exc:
        raise bad("dataset", str(exc)) from None
    named = re.fullmatch(rf"{re.escape(source.name)}-s{source.seed}-e(\d+)-(\d+)", prompt.prompt_id)
    if named is None or int(named[2]) != prompt.index or not 0 <= prompt.index < source.size:
        raise bad("prompt_id", f"{prompt.prompt_id!r} (index {prompt.index}) names no row of source {source.name!r}")
    if not 0 <= prompt.attempt <= cfg.buffer.max_retries:
        raise bad("attempt", f"attempt {prompt.attempt} (buffer.max_retries {cfg.buffer.max_retries})")
    expected = source.prompt(int(named[1]), prompt.index)
    for field in ("question", "answer", "entry_json"):
        if getattr(prompt, field) != getattr(expected, field):
            raise bad(field, f"not the {field} of row {prompt.index} of source {source.name!r}")
