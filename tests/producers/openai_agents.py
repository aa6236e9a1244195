"""What the OpenAI-endpoint tests share: a recording engine, a scripted calculator policy, an agent's config
and rollout context."""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from milestream.config import Config
from milestream.engines.engine import GenerateRequest, GenerateResult, sampling_params
from milestream.producers.rollout import RolloutContext, load_layers
from milestream.schemas.records import Prompt

OPENAI_LAYERS = {"generate_fn": "milestream.producers.agents:openai_episode",
                 "agent_fn": "examples.openai_agent.agent:solve"}


class Recording:
    """An engine that keeps every request and result (by request id) of the engine it wraps."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.turns: list[tuple[GenerateRequest, GenerateResult]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        result = await self.engine.generate(request)
        self.turns.append((request, result))
        return result


class CalculatorScript:
    """Turn 1 calls the calculator on the question's expression, turn 2 answers with the tool's result read
    from its prompt; each turn at a weight version of its own, with made-up log-probs."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.version = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        # the conversation since its last question (the agent's worked example comes before it)
        shown = self.tokenizer.decode(request.input_ids).rpartition("<|im_start|>user\n")[2]
        tool_result = re.search(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", shown)
        if tool_result is None:
            expression = re.search(r"problem: (.*) =", shown).group(1)
            text = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        else:
            text = f"<answer>{tool_result[1]}</answer>"
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + (self.tokenizer.eos_token_id,)
        self.version += 1
        logprobs = tuple(-0.1 * (i + 1) for i in range(len(ids)))
        return GenerateResult(request.request_id, ids, logprobs, (self.version,) * len(ids), "stop")


def agent_cfg(**rollout: Any) -> Config:
    return Config().with_overrides(model={"name": "tiny-random", "dtype": "float32", "lora_rank": 0},
                                   data={"assistant_prefill": ""},
                                   rollout={**OPENAI_LAYERS, "max_new_tokens": 64, **rollout})


def context(cfg: Config, engine: Any, tokenizer: PreTrainedTokenizerBase) -> RolloutContext:
    return RolloutContext(cfg, "w", engine, tokenizer, sampling_params(cfg.rollout, tokenizer), None,
                          load_layers(cfg).agent)


def prompt(question: str, answer: str = "") -> Prompt:
    return Prompt("p0", "chain_sum", 0, question, answer, json.dumps({"question": question, "answer": answer}))


def with_agent(ctx: RolloutContext, agent: Callable[..., Any]) -> RolloutContext:
    return RolloutContext(ctx.cfg, ctx.worker_id, ctx.engine, ctx.tokenizer, ctx.sampling, ctx.generate, agent)
