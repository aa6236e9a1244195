"""The user's inputs checked before any stage starts (``milestream run``, ``milestream load-prompts``).

Every data source and ``eval.path`` is read and mapped (a missing file or column, a malformed JSONL
line, an empty data set are errors naming file and line or column), the reward's import path is
resolved, and every file prompt must fit the context with ``rollout.max_new_tokens`` to spare.
"""
from __future__ import annotations

from milestream.config import Config
from milestream.infra.model import load_tokenizer
from milestream.producers.data import DataError, held_out, prompt_messages, sources
from milestream.producers.rewards import load_reward
from milestream.producers.tasks import chat_input_ids


def context_limit(cfg: Config) -> int:
    """The most tokens a prompt and its response may take (the model's own limit joins here)."""
    return cfg.rollout.max_context_tokens


def check_inputs(cfg: Config) -> None:
    """Raise DataError naming what is wrong with the run's inputs."""
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
