"""infra/on_policy.py on its own: a row of a RowBlockLinear computes alike whatever the rows around it,
and what exact attention cannot compute alike is refused, naming the knob (the engine against the
trainer is tests/engines/test_true_on_policy.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

from milestream.infra import on_policy

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_linear_output_does_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 80)
    layer.__class__ = on_policy.RowBlockLinear
    rows = torch.randn(40, 96)
    with torch.no_grad(), on_policy.autocast(dtype):
        alone = torch.cat([layer(rows[i:i + 1]) for i in range(40)])
        for count in (2, 3, 5, 7, 11, 16, 27, 40):  # 1 to 3 rows short of a multiple of 4, and whole ones
            assert torch.equal(layer(rows[:count]), alone[:count])


def test_attention_logit_softcapping_is_refused() -> None:
    model = Gemma2ForCausalLM(Gemma2Config(**SMALL))
    with pytest.raises(ValueError, match="rollout.true_on_policy: Gemma2ForCausalLM caps its attention logits"):
        on_policy.make_exact(model)


def test_a_sliding_window_shorter_than_the_sequence_is_refused_at_the_forward() -> None:
    model = on_policy.make_exact(MistralForCausalLM(MistralConfig(sliding_window=4, **SMALL)))
    with torch.no_grad():
        model(input_ids=torch.arange(4)[None])  # within the window: every key of every query
        with pytest.raises(ValueError, match="no sliding window shorter than the sequence.*true_on_policy=false"):
            model(input_ids=torch.arange(8)[None])
