"""Tool-use environments on reasoning-gym questions, tools run in a per-episode sandbox.

Two agent functions (``rollout.agent_fn``, with ``rollout.generate_fn``
``milestream.producers.rollout:agent_episode``), for up to ``rollout.max_turns`` assistant turns:

- ``python_tool_agent``: function calling. The tools ``python`` (run code, get what it prints) and
  ``calculator`` (one arithmetic expression) are offered through the chat template; the policy calls
  them with ``<tool_call>`` blocks and answers when it stops calling.
- ``interpreter_agent``: a code interpreter, for models too small to call functions (SmolLM2-135M
  never emits a tool call): every assistant message without an ``<answer>`` tag is run as Python,
  REPL-style (the last expression's value is printed), and the output, or the error, comes back
  as a tool turn; a message with the tag ends the episode. The last allowed turn is opened with
  the task's ``data.assistant_prefill`` (``<answer>``), so every episode ends in an answer.

Each episode has its own sandbox (``sandbox.py``: a fresh folder, removed afterwards; each tool
call under bubblewrap with no network, a read-only system, no view of other processes and time,
memory and process limits; no tools at all where that isolation is missing, unless
``sandbox.allow_weak``). Tool results enter the conversation as ``tool`` messages; the session
records them with loss mask 0, so the policy is trained only on its own tokens. The final
assistant message is what the task's verifier scores.
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from milestream.config import SandboxConfig
from milestream.producers.environments.sandbox import Sandbox, SandboxLimits, ToolRun
from milestream.producers.rollout import ChatFn, Episode, RolloutContext
from milestream.schemas.records import Prompt

TOOLS: list[dict] = [
    {"type": "function", "function": {
        "name": "python", "description": "Run Python 3 code in a fresh sandbox and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate one arithmetic expression, e.g. 12 * (3 - 5).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
TOOL_HINT = " You may call the python or calculator tool first; finish with the answer."
INTERPRETER_HINT = (" Every message you write without an <answer> tag is run as Python and you are shown what it "
                    "prints (or the value of its last expression). Compute first; your last message is the answer.")

# the calculator evaluates in the sandbox too: no names but math's, no builtins
_CALCULATOR = "import math\nprint(eval({expression!r}, {{'__builtins__': {{}}}}, vars(math)))\n"
# a message run as a REPL cell: everything, then the value of a final expression printed
_REPL = """import ast
tree = ast.parse({code!r})
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
scope = {{"__name__": "__main__"}}
exec(compile(tree, "<cell>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
    if value is not None:
        print(value)
"""
_FENCE = re.compile(r"```(?:python|py)?\n?(.*?)```", re.DOTALL)


def sandbox(cfg: SandboxConfig) -> Sandbox:
    """An episode's sandbox; entering it raises ``SandboxUnavailable`` where tools cannot be isolated and
    ``sandbox.allow_weak`` is off, or calls cannot be capped and ``sandbox.allow_uncapped`` is off: the sample
    fails (a deployment fault, not the policy's), so the worker publishes the group as an error and stops after
    ``rollout.max_errors`` of them, naming the reason, rather than train on episodes whose tools always fail."""
    limits = SandboxLimits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, max_output_chars=cfg.max_output_chars,
                           max_processes=cfg.max_processes)
    return Sandbox(limits, bwrap=cfg.bwrap, allow_weak=cfg.allow_weak, allow_uncapped=cfg.allow_uncapped)


async def python_tool_agent(chat: ChatFn, prompt: Prompt, ctx: RolloutContext) -> Episode:
    def act(sandbox: Sandbox, reply: dict) -> list[dict] | None:
        calls = reply.get("tool_calls") or []
        return [{"role": "tool", "name": _function(call).get("name", ""), "content": run_tool_call(sandbox, call)}
                for call in calls] or None

    return await _episode(chat, prompt, ctx, TOOL_HINT, TOOLS, act)


async def interpreter_agent(chat: ChatFn, prompt: Prompt, ctx: RolloutContext) -> Episode:
    def act(sandbox: Sandbox, reply: dict) -> list[dict] | None:
        content = reply.get("content") or ""
        return None if "<answer>" in content else [{"role": "tool", "name": "python",
                                                     "content": run_cell(sandbox, content)}]

    return await _episode(chat, prompt, ctx, INTERPRETER_HINT, None, act, ctx.cfg.data.assistant_prefill)


async def _episode(chat: ChatFn, prompt: Prompt, ctx: RolloutContext, hint: str, tools: list[dict] | None,
                   act: Callable[[Sandbox, dict], list[dict] | None], last_prefill: str = "") -> Episode:
    """The question, then turns until ``act`` finds no tool work in a reply (the final answer) or
    ``rollout.max_turns`` runs out; ``act`` runs the tools (off the event loop) into tool messages.
    The last turn opens with ``last_prefill``; the answer text is what follows the task's prefill."""
    messages: list[dict] = [{"role": "system", "content": ctx.cfg.data.system_prompt + hint},
                            {"role": "user", "content": prompt.question}]
    tool_turns = 0
    with sandbox(ctx.cfg.sandbox) as box:
        for turn in range(ctx.cfg.rollout.max_turns):
            reply = await chat(messages, tools, last_prefill if turn == ctx.cfg.rollout.max_turns - 1 else "")
            messages.append(reply)
            results = await asyncio.to_thread(act, box, reply)
            if results is None:
                answer = (reply.get("content") or "").removeprefix(ctx.cfg.data.assistant_prefill)
                return Episode(answer_text=answer, tool_calls=tool_turns)
            tool_turns += len(results)
            messages.extend(results)
    return Episode(answer_text="", tool_calls=tool_turns)  # out of turns while still using tools


def run_cell(sandbox: Sandbox, content: str) -> str:
    """A message as a REPL cell: its fenced code if it has some, else the whole message."""
    fenced = _FENCE.findall(content)
    return _tool_text(sandbox, sandbox.run_python(_REPL.format(code="\n".join(fenced) if fenced else content)))


def run_tool_call(sandbox: Sandbox, call: dict) -> str:
    """The text a tool call gives back to the model; a bad call gets an error message, not an exception."""
    function = _function(call)
    name, arguments = function.get("name"), _arguments(function.get("arguments"))
    if name == "python" and isinstance(arguments.get("code"), str):
        run = sandbox.run_python(arguments["code"])
    elif name == "calculator" and isinstance(arguments.get("expression"), str):
        run = sandbox.run_python(_CALCULATOR.format(expression=arguments["expression"]))
    else:
        return f"error: unknown tool call {json.dumps(function)[:200]}; tools: python(code), calculator(expression)"
    return _tool_text(sandbox, run)


def _tool_text(sandbox: Sandbox, run: ToolRun) -> str:
    if run.timed_out:
        return f"error: timed out after {sandbox.limits.timeout_s:g} s"
    if run.ok:
        return run.stdout
    # the exception line is what a model can act on; the sandbox's own frames are noise to it
    lines = run.stderr.strip().splitlines() or [f"exit status {run.exit_code}"]
    return f"error: {lines[-1][:500]}"


def _function(call: dict) -> dict:
    return call.get("function", call) if isinstance(call, dict) else {}


def _arguments(raw: Any) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        parsed = json.loads(raw) if isinstance(raw, str) else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}
