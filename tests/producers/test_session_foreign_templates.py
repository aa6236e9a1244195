"""Sessions driven by tokenizers the project has not seen, built offline: SmolLM2's tokenizer with added
special tokens and a hand-written chat template in the style of Gemma, Llama-3 and Mistral, saved to a
folder and loaded back. Each of the generic fallback's three former defects has its test here."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from model_folders import STYLES, foreign_tokenizer, styled

from milestream.config import ModelConfig, RolloutConfig
from milestream.engines.engine import sampling_params
from milestream.infra.model import load_tokenizer
from milestream.producers.sessions.templates import TemplateError, chat_template
from milestream.producers.sessions.tito import TokenSession

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
    tokenizer = styled(tmp_path / style, style)
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
    tokenizer = styled(tmp_path / "mistral", "mistral")
    template = chat_template(tokenizer)
    session = TokenSession(template)
    request = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert template.decode(session.prompt_ids(request)) == "<s>[INST] Be brief.\n\nhi[/INST]"
    generated = [*template.encode("ok"), template.end_of_turn_id]
    reply = session.record(generated, [-0.5] * len(generated), [0] * len(generated))
    with pytest.raises(TemplateError, match=r"messages\[2\]: .* renders the prompt of its last assistant turn "
                                            r"differently .*'Be brief"):
        session.prompt_ids([*request, reply, {"role": "user", "content": "again"}])
