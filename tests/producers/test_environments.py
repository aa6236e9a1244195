"""The multi-turn layers: the per-episode sandbox, a tool-use episode's tokens and loss masks, and
the rollout worker running agent episodes against the real broker.

The policy here is a scripted engine (the ``Engine`` protocol, emitting prepared token ids) so
that tool calls happen for sure; tokenizer, session, sandbox, worker, broker and Redis are real.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import re
import time

import pytest

from milestream.infra.kafka import RecordConsumer
from milestream.infra.model import load_tokenizer
from milestream.engines.engine import GenerateRequest, GenerateResult, sampling_params
from milestream.producers.environments.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from milestream.producers.environments.tool_use import run_tool_call
from milestream.producers.loader import load_prompts
from milestream.producers.rollout import RolloutContext, load_layers
from milestream.producers.tasks import iter_prompts
from milestream.producers.worker import RolloutWorker
from milestream.schemas import topics
from milestream.schemas.records import Prompt

TOOL_LAYERS = {"generate_fn": "milestream.producers.rollout:agent_episode",
               "agent_fn": "milestream.producers.environments.tool_use:python_tool_agent"}


def calculator_call(expression: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


class ScriptedEngine:
    """Turn 1 works on the question's expression (by default a calculator call); turn 2 answers
    ``<answer>N</answer>``, N being the tool's result as read from its prompt."""

    def __init__(self, tokenizer, first_turn=calculator_call, version: int = 0) -> None:
        self.tokenizer, self.first_turn, self._version = tokenizer, first_turn, version

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        shown = self.tokenizer.decode(request.input_ids)
        if request.request_id.endswith("/turn0"):
            text = self.first_turn(re.search(r"problem: (.*) =", shown).group(1))
        else:
            result = shown.rsplit('<|im_start|>tool', 1)[1].split()[0]
            text = f"{result}</answer>" if shown.endswith("<answer>") else f"<answer>{result}</answer>"
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + (self.tokenizer.eos_token_id,)
        return GenerateResult(request.request_id, ids, tuple(-0.5 for _ in ids), (self._version,) * len(ids), "stop")

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, version: int, tensors) -> None:
        self._version = version


# ---- the sandbox --------------------------------------------------------------------------------------

def test_sandbox_is_fresh_per_episode_and_gone_after():
    with Sandbox() as first, Sandbox() as second:
        assert first.folder != second.folder
        assert first.run_python("open('notes.txt', 'w').write('x'); import os; print(os.listdir('.'))").stdout == \
            "['notes.txt']\n"
        assert second.run_python("import os; print(os.listdir('.'))").stdout == "[]\n"
        folders = first.folder, second.folder
    assert not any(folder.exists() for folder in folders)


def test_sandbox_limits_time_memory_and_network():
    with Sandbox(SandboxLimits(timeout_s=1.0, memory_mb=256)) as sandbox:
        spin = sandbox.run_python("while True: pass")
        assert spin.timed_out and not spin.ok
        hog = sandbox.run_python("block = bytearray(1024 ** 3)")
        assert not hog.ok and "MemoryError" in hog.stderr
        dial = sandbox.run_python("import socket; socket.create_connection(('127.0.0.1', 9), timeout=1)")
        assert not dial.ok and "no network" in dial.stderr
        interfaces = sandbox.run_python("import socket; print([name for _, name in socket.if_nameindex()])")
        assert interfaces.stdout == "['lo']\n"  # below Python, too: a network namespace with its own loopback only


def test_tool_calls_give_text_back_never_raise():
    with Sandbox(SandboxLimits(timeout_s=1.0)) as sandbox:
        call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12 * (3 - 5)"}'}}
        assert run_tool_call(sandbox, call) == "-24\n"
        assert run_tool_call(sandbox, {"function": {"name": "python", "arguments": {"code": "print(sum(range(5)))"}}}) \
            == "10\n"
        escape = run_tool_call(sandbox, {"function": {"name": "calculator", "arguments": {"expression": "__import__('os')"}}})
        assert escape.startswith("error: NameError")  # no builtins to import with
        assert run_tool_call(sandbox, {"function": {"name": "shell", "arguments": {}}}).startswith("error: unknown tool")
        assert run_tool_call(sandbox, {"function": {"name": "python", "arguments": {"code": "while 1: pass"}}}) == \
            "error: timed out after 1 s"


def test_interpreter_episode_runs_each_message_as_a_cell(cfg):
    """agent_episode + interpreter_agent without a broker: the tool turn carries the cell's output,
    the last turn opens with the task's prefill (not trained on)."""
    cfg = cfg.with_overrides(rollout={"generate_fn": TOOL_LAYERS["generate_fn"], "max_new_tokens": 64, "max_turns": 2,
                                      "agent_fn": "milestream.producers.environments.tool_use:interpreter_agent"})
    tokenizer = load_tokenizer(cfg.model)
    engine = ScriptedEngine(tokenizer, first_turn=lambda expression: f"```python\n{expression}\n```")
    layers = load_layers(cfg)

    async def generate(task, index):
        return await layers.generate(ctx, task.prompt, f"{task.prompt.group_id}/{index}")

    ctx = RolloutContext(cfg, "w", engine, tokenizer, sampling_params(cfg.rollout, tokenizer), generate, layers.agent)
    task = next(iter_prompts(cfg.data))
    prompt = Prompt("p0", cfg.data.task, task.index, task.question, task.answer, json.dumps(task.entry))
    sample = asyncio.run(layers.generate(ctx, prompt, "g/0"))
    assert sample.turns == 2 and sample.tool_calls == 1 and sample.finish_reason == "stop"
    (reward,) = asyncio.run(ctx.score(prompt, [sample]))
    assert reward.value == pytest.approx(1.1) and not reward.error
    tool_span = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if m == 0])
    assert f"tool\n{task.answer}\n" in tool_span and tool_span.endswith("assistant\n<answer>")
    assert tokenizer.decode(sample.response_ids).endswith(f"<answer>{task.answer}</answer><|im_end|>")


def test_an_episode_without_isolation_fails_rather_than_run_tools(cfg):
    """bubblewrap missing and sandbox.allow_weak off: the sample fails (the worker publishes its group as
    an error) before the policy's first turn, naming the reason."""
    cfg = cfg.with_overrides(rollout={"generate_fn": TOOL_LAYERS["generate_fn"], "max_new_tokens": 64, "max_turns": 2,
                                      "agent_fn": "milestream.producers.environments.tool_use:interpreter_agent"},
                             sandbox={"bwrap": "/nonexistent/bwrap"})
    tokenizer = load_tokenizer(cfg.model)
    engine = ScriptedEngine(tokenizer, first_turn=lambda expression: f"```python\n{expression}\n```")
    layers = load_layers(cfg)
    ctx = RolloutContext(cfg, "w", engine, tokenizer, sampling_params(cfg.rollout, tokenizer), None, layers.agent)
    task = next(iter_prompts(cfg.data))
    prompt = Prompt("p0", cfg.data.task, task.index, task.question, task.answer, json.dumps(task.entry))
    with pytest.raises(SandboxUnavailable, match="bubblewrap \\(/nonexistent/bwrap\\) is not installed"):
        asyncio.run(layers.generate(ctx, prompt, "g/0"))


# ---- an episode through the worker ----------------------------------------------------------------------

@pytest.fixture
def tool_cfg(cfg):
    return cfg.with_overrides(rollout={**TOOL_LAYERS, "group_size": 2, "max_new_tokens": 64, "max_turns": 3},
                              data={"assistant_prefill": ""})


def test_worker_runs_tool_use_episodes_with_loss_masks(tool_cfg):
    cfg = tool_cfg
    load_prompts(cfg, count=4)
    tokenizer = load_tokenizer(cfg.model)
    engine = ScriptedEngine(tokenizer)
    worker = RolloutWorker(cfg, "w-tools", engine, tokenizer)
    worker.weights_ready.set()  # the scripted engine needs no weights
    trajectories = RecordConsumer(cfg.broker, topics.TRAJECTORIES, "audit").assign(partitions=range(cfg.broker.partitions))
    seen = []

    async def until_published(count: int) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        deadline = time.monotonic() + 120
        while len(seen) < count and time.monotonic() < deadline:
            for delivery in await asyncio.to_thread(trajectories.drain, 0.5, 5.0):
                seen.extend(delivery.records)
        stop.set()
        await task

    asyncio.run(until_published(cfg.buffer_capacity * cfg.rollout.group_size))
    trajectories.close()
    assert len(seen) == cfg.buffer_capacity * cfg.rollout.group_size
    for trajectory in seen:
        assert_tool_episode(trajectory, tokenizer)


def assert_tool_episode(trajectory, tokenizer) -> None:
    """Two generated turns around one tool turn: masks 1 exactly over what the engine generated."""
    mask, ids = trajectory.loss_mask, trajectory.response_ids
    spans = [(bit, len(list(run))) for bit, run in itertools.groupby(mask)]
    assert [bit for bit, _ in spans] == [1, 0, 1], spans
    generated = [tokenizer.decode([t for t, m in zip(ids, mask) if m == bit]) for bit in (1, 0)]
    answer = int(eval(re.search(r"problem: (.*) =", tokenizer.decode(trajectory.prompt_ids)).group(1)))
    assert '"expression":' in generated[0] and f"<answer>{answer}</answer>" in generated[0]
    assert f"tool\n{answer}" in generated[1] and "<answer>" not in generated[1]  # the tool's result, not trained on
    assert trajectory.reward == pytest.approx(1.1) and trajectory.status == "completed"
    assert len(trajectory.token_versions) == len(ids) and min(trajectory.token_versions) == 0
    assert trajectory.response_text == tokenizer.decode(ids, skip_special_tokens=True)  # readable for humans
