"""The chain_sum task: deterministic prompts, their ChatML encoding, and the reward."""
from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerBase

from milestream.config import DataConfig
from milestream.producers.tasks import build_input_ids, iter_prompts, score

DATA = DataConfig()


def test_prompts_are_deterministic_and_resumable() -> None:
    first = list(iter_prompts(DATA, stop=20))
    assert first == list(iter_prompts(DATA, stop=20))
    assert list(iter_prompts(DATA, start=10, stop=20)) == first[10:]
    assert [p.index for p in first] == list(range(20))
    other_seed = list(iter_prompts(DATA.model_copy(update={"seed": 7}), stop=20))
    assert [p.question for p in other_seed] != [p.question for p in first]


def test_prompt_entries_are_json_and_self_consistent() -> None:
    for prompt in iter_prompts(DATA, stop=20):
        assert json.loads(json.dumps(prompt.entry)) == prompt.entry
        assert prompt.entry["question"] == prompt.question
        assert prompt.entry["answer"] == prompt.answer
        assert score(f"{prompt.answer}</answer>", prompt.entry, DATA) == pytest.approx(1.1)


def test_stop_is_capped_at_the_dataset_size() -> None:
    small = DATA.model_copy(update={"size": 5})
    assert [p.index for p in iter_prompts(small, start=3, stop=100)] == [3, 4]


def test_input_ids_are_chatml_with_the_prefill(tokenizer: PreTrainedTokenizerBase) -> None:
    question = "State the final answer to the following arithmetic problem: 4 + 3 ="
    text = tokenizer.decode(build_input_ids(tokenizer, question, DATA))
    assert text == (
        "<|im_start|>system\nAnswer inside <answer></answer> tags.<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n<answer>"
    )


ENTRY = {"question": "What is 4 + 3?", "answer": "7", "metadata": {}}
NEGATIVE = {"question": "What is 2 - 7?", "answer": "-5", "metadata": {}}


@pytest.mark.parametrize(
    ("completion", "entry", "reward"),
    [
        ("7</answer>", ENTRY, 1.1),  # correct, tag closed
        ("9</answer>", ENTRY, 0.1),  # wrong, tag closed: only the format reward
        ("7", ENTRY, 0.0),  # never closed
        ("7 and then some", ENTRY, 0.0),
        ("4 + 3 = 7</answer><|im_end|>", ENTRY, 1.1),  # the last number inside the tag counts
        ("7 + 0 = 8</answer> so 7", ENTRY, 0.1),  # text after the tag does not
        ("</answer>", ENTRY, 0.1),  # closed but empty
        (" -5 </answer>", NEGATIVE, 1.1),
        ("5</answer>", NEGATIVE, 0.1),
    ],
)
def test_reward_on_hand_written_completions(completion: str, entry: dict, reward: float) -> None:
    assert score(completion, entry, DATA) == pytest.approx(reward)


def test_reward_follows_the_configured_prefill_and_format_reward() -> None:
    no_prefill = DATA.model_copy(update={"assistant_prefill": "", "format_reward": 0.5})
    assert score("The sum is <answer>7</answer>", ENTRY, no_prefill) == pytest.approx(1.5)
    assert score("7</answer>", ENTRY, no_prefill) == 0.0  # without the prefill the tag never opened
