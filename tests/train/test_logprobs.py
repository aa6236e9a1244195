from collections.abc import Sequence

import torch
from torch import Tensor, nn

from milestream.config import ModelConfig
from milestream.infra.model import load_model
from milestream.train.logprobs import shared_prompt_logprobs
from milestream.train.tensor_ops import token_logprobs


def plain_logprobs(model: nn.Module, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                   temperature: float = 1.0) -> Tensor:
    """The same figures from one full forward per sequence: the reference the shared path must match."""
    longest = max(len(r) for r in responses)
    out = []
    for response in responses:
        row = torch.tensor(list(prompt_ids) + list(response))
        logits = model(input_ids=row.unsqueeze(0)).logits[0, len(prompt_ids) - 1:-1]
        logp = token_logprobs(logits / max(temperature, 1e-6), row[len(prompt_ids):])
        out.append(torch.nn.functional.pad(logp, (0, longest - len(response))))
    return torch.stack(out)


def test_shared_prompt_matches_plain_forward_values_and_gradients():
    model = load_model(ModelConfig(name="tiny-random", dtype="float32", lora_rank=4, seed=1), dtype=torch.float32)
    prompt = [5, 17, 300, 42, 7]
    responses = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    shared = shared_prompt_logprobs(model, prompt, responses, temperature=0.7)
    reference = plain_logprobs(model, prompt, responses, temperature=0.7)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    assert torch.allclose(shared * mask, reference * mask, atol=1e-5)

    params = [p for p in model.parameters() if p.requires_grad]
    grads_shared = torch.autograd.grad((shared * mask).sum(), params)
    grads_plain = torch.autograd.grad((reference * mask).sum(), params)
    for a, b in zip(grads_shared, grads_plain):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
