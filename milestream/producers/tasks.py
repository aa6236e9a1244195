"""The reasoning-gym task: its prompts, their chat encoding, and its answer-tag reward.

reasoning-gym datasets are procedural: entry ``i`` is generated from ``seed + i`` on access, so a
producer can start at any index without generating the ones before it, and every process that
builds the dataset from the same ``DataConfig`` sees the same entries.
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from milestream.config import DataConfig

if TYPE_CHECKING:  # the loader publishes prompts without a tokenizer; a local-file task needs no reasoning-gym
    from reasoning_gym.dataset import ProceduralDataset
    from transformers import PreTrainedTokenizerBase

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class TaskPrompt:
    index: int  # position in the dataset; with the config it identifies the prompt
    question: str
    answer: str
    entry: dict[str, Any]  # the full entry as JSON-safe data: all ``score`` needs later


def iter_prompts(data_cfg: DataConfig, *, start: int = 0, stop: int | None = None) -> Iterator[TaskPrompt]:
    """Entries ``start`` .. ``stop`` (default: the configured size) in index order."""
    dataset = _dataset(data_cfg.task, _options_key(data_cfg), data_cfg.size, data_cfg.seed)
    for index in range(start, data_cfg.size if stop is None else min(stop, data_cfg.size)):
        entry = _json_safe(dataset[index], data_cfg.task)
        yield TaskPrompt(index=index, question=entry["question"], answer=str(entry["answer"]), entry=entry)


def build_input_ids(tokenizer: PreTrainedTokenizerBase, question: str, data_cfg: DataConfig) -> list[int]:
    """System prompt, the question as the user turn, and the assistant turn opened and pre-filled."""
    messages = [
        {"role": "system", "content": data_cfg.system_prompt},
        {"role": "user", "content": question},
    ]
    return chat_input_ids(tokenizer, messages, data_cfg.assistant_prefill)


def chat_input_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], prefill: str) -> list[int]:
    """The messages through the chat template, the assistant turn opened and pre-filled.

    The whole text is tokenized at once so the prefill merges with the turn header exactly as
    the trainer would see it if it ever re-tokenized prompt text.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text + prefill, add_special_tokens=False)["input_ids"])


def score(completion_text: str, entry: dict[str, Any], data_cfg: DataConfig) -> float:
    """The reasoning-gym verdict on the answer in the tag, plus the format reward (``tag_score``)."""
    dataset = _dataset(data_cfg.task, _options_key(data_cfg), data_cfg.size, data_cfg.seed)
    return tag_score(completion_text, data_cfg, lambda answer: float(dataset.score_answer(answer, entry)))


def tag_score(completion_text: str, data_cfg: DataConfig, judge: Callable[[str | None], float]) -> float:
    """``judge`` of the last number in the first closed answer tag, plus the format reward.

    The completion continues the pre-filled assistant turn, so the prefill is put back in front
    before looking for the tag. No closed tag scores 0: the format reward is what makes the
    base model's rare closed tags stand out within a group.
    """
    match = _ANSWER.search(data_cfg.assistant_prefill + completion_text)
    if match is None:
        return 0.0
    numbers = _NUMBER.findall(match.group(1))
    return judge(numbers[-1] if numbers else None) + data_cfg.format_reward


def _options_key(data_cfg: DataConfig) -> str:
    # task_options is a dict, so the config itself cannot key a cache; its canonical JSON can.
    return json.dumps(data_cfg.task_options, sort_keys=True)


@functools.lru_cache(maxsize=8)
def _dataset(task: str, options_json: str, size: int, seed: int) -> ProceduralDataset:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed, **json.loads(options_json))


def _json_safe(entry: dict[str, Any], task: str) -> dict[str, Any]:
    # Entries travel through the broker as JSON; a task whose metadata is not JSON must fail
    # here, at the producer, rather than as a scoring error far downstream.
    try:
        return json.loads(json.dumps(entry))
    except TypeError as exc:
        raise TypeError(f"reasoning-gym task {task!r} has entries that are not JSON-serialisable: {exc}") from exc
