"""Sessions driven by tokenizers the project has not seen, built offline: SmolLM2's tokenizer with added
special tokens and a hand-written chat template in the style of Gemma, Llama-3 and Mistral, saved to a
folder and loaded back. Each of the generic fallback's three former defects has its test here."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from milestream.config import ModelConfig, RolloutConfig
from milestream.engines.engine import sampling_params
from milestream.infra.model import load_tokenizer
from milestream.producers.sessions.templates import TemplateError, chat_template
from milestream.producers.sessions.tito import TokenSession

GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# the system prompt goes into the last user turn, as some Mistral templates do: earlier turns re-render
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
           "{% set turns = messages[1:] %}{% else %}{% set turns = messages %}{% endif %}{{ bos_token }}"
           "{% for m in turns %}{% if m['role'] == 'user' %}"
           "{% if loop.last and system is defined %}[INST] {{ system }}\n\n{{ m['content'] }}[/INST]"
           "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
           "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
STYLES = {  # template, special tokens added, bos, eos, end of an assistant turn
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>",
               "<|end_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, ["[INST]", "[/INST]"], "<s>", "</s>", "</s>"),
}


def foreign_tokenizer(folder: Path, template: str, added: list[str] = (), bos: str | None = None,
                      eos: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(ModelConfig(name="tiny-random"))
    special: dict = {"additional_special_tokens": list(added)} if added else {}
    special.update({key: value for key, value in (("bos_token", bos), ("eos_token", eos)) if value})
    tokenizer.add_special_tokens(special)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def styled(tmp_path: Path, style: str) -> PreTrainedTokenizerBase:
    template, added, bos, eos, _ = STYLES[style]
    return foreign_tokenizer(tmp_path / style, template, added, bos, eos)


def test_smollm2_vocabulary_with_its_own_template_is_not_given_chatml(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    own = "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}" \
          "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
    tokenizer = foreign_tokenizer(tmp_path / "own", own)
    assert len(tokenizer) == 49_152  # SmolLM2's vocabulary, untouched
    with caplog.at_level(logging.INFO):
        template = chat_template(tokenizer)
    assert template.name == "generic" and "a chat template of its own" in caplog.text
    messages = [{"role": "user", "content": "hi"}]
    session = TokenSession(template)
    assert template.decode(session.prompt_ids(messages)) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    smollm2 = foreign_tokenizer(tmp_path / "smollm2", load_tokenizer(ModelConfig(name="tiny-random")).chat_template)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert chat_template(smollm2).name == "smollm2"  # its own template: the template as code
    assert "smollm2 (template as code)" in caplog.text


@pytest.mark.parametrize("style", ["gemma", "llama3"])
def test_a_turn_ends_with_the_templates_end_of_turn_not_the_eos(tmp_path: Path, style: str) -> None:
    tokenizer = styled(tmp_path, style)
    template = chat_template(tokenizer)
    end = tokenizer.convert_tokens_to_ids(STYLES[style][4])
    assert template.name == "generic" and template.end_of_turn_id == end != tokenizer.eos_token_id
    assert sampling_params(RolloutConfig(), tokenizer).stop_token_ids == (end, tokenizer.eos_token_id)
    session = TokenSession(template)
    request = [{"role": "user", "content": "hi"}]
    session.prompt_ids(request)
    generated = [*template.encode("ok"), end]
    reply = session.record(generated, [-0.5] * len(generated), [0] * len(generated))
    single = session.samples()[0]
    assert single.response_ids == generated and single.loss_mask == [1] * len(generated)  # no stray token
    second = [*request, reply, {"role": "user", "content": "again"}]
    assert template.decode(session.prompt_ids(second)) == tokenizer.apply_chat_template(
        second, tokenize=False, add_generation_prompt=True)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path) -> None:
    tokenizer = styled(tmp_path, "mistral")
    template = chat_template(tokenizer)
    session = TokenSession(template)
    request = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.decode(session.prompt_ids(request)) == "<s>[INST] Be brief.\n\nhi[/INST]"
    generated = [*template.encode("ok"), template.end_of_turn_id]
    reply = session.record(generated, [-0.5] * len(generated), [0] * len(generated))
    with pytest.raises(TemplateError, match=r"messages\[2\]: .* renders the prompt of its last assistant turn "
                                            r"differently .*'Be brief"):
        session.prompt_ids([*request, reply, {"role": "user", "content": "again"}])
