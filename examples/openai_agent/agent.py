"""An agent written only against the ``openai`` package: milestream trains it unchanged.

It answers arithmetic questions over several turns with a calculator tool: it sends the conversation
(after one worked example: a question, the call, the tool's result, the answer) to the chat completions API, runs every tool call the model makes and sends the results back, until
the model answers without calling a tool; the answer is the last number of that reply, in the
``<answer></answer>`` tags the task's verifier reads. Nothing here knows about milestream: the training
run calls ``solve`` with the base url of a per-episode endpoint in front of the policy, an api key and
the task (``prompt.question``), and scores the string it returns. The same function runs against any
OpenAI-compatible server: ``solve("https://api.openai.com/v1", KEY, question)`` with a question string.
"""
from __future__ import annotations

import ast
import json
import operator
import re

from openai import OpenAI

MAX_TURNS = 3
SYSTEM = ("Compute with the calculator tool, then give the result as the answer. To compute 2 + 3, reply "
          'exactly:\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate one arithmetic expression, e.g. 12 * (3 - 5).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
RESPONSE_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # the Responses API's shape of the same tool
# one worked episode before the question (few-shot): a small model copies the call's format far more often
# from an example than from the instructions alone
_DEMO_CALL = {"id": "call_demo", "type": "function",
              "function": {"name": "calculator", "arguments": json.dumps({"expression": "7 * 6 - 5"})}}
DEMO = [{"role": "user", "content": "State the final answer to the following arithmetic problem: 7 * 6 - 5 ="},
        {"role": "assistant", "content": "", "tool_calls": [_DEMO_CALL]},
        {"role": "tool", "tool_call_id": "call_demo", "content": "37"},
        {"role": "assistant", "content": "<answer>37</answer>"}]
DEMO_ITEMS = [DEMO[0], {"type": "function_call", "call_id": "call_demo", **_DEMO_CALL["function"]},
              {"type": "function_call_output", "call_id": "call_demo", "output": "37"}, DEMO[3]]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def solve(base_url: str, api_key: str, prompt) -> str:
    """The final answer of one episode, ``<answer>N</answer>`` ("" when the model kept calling tools until
    MAX_TURNS or wrote no number)."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    question = getattr(prompt, "question", prompt)
    messages: list = [{"role": "system", "content": SYSTEM}, *DEMO, {"role": "user", "content": question}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            return answer(reply.content or "")
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function)})
    return ""


def solve_with_responses(base_url: str, api_key: str, prompt) -> str:
    """``solve`` written against the Responses API (``client.responses.create``): the same episode, the
    conversation sent whole each turn (the previous input, the response's output, the tools' outputs)."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    items: list = [*DEMO_ITEMS, {"role": "user", "content": getattr(prompt, "question", prompt)}]
    for _ in range(MAX_TURNS):
        response = client.responses.create(model="policy", instructions=SYSTEM, input=items, tools=RESPONSE_TOOLS)
        items += response.output
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return answer(response.output_text)
        items += [{"type": "function_call_output", "call_id": call.call_id, "output": run_tool(call)} for call in calls]
    return ""


def answer(text: str) -> str:
    """The reply's last number in the task's answer tags ("" when it has none)."""
    numbers = _NUMBER.findall(text)
    return f"<answer>{numbers[-1]}</answer>" if numbers else ""


def run_tool(function) -> str:
    """The text a call (its ``name`` and ``arguments``) gives back: the result, or an error the model can read
    (never an exception)."""
    try:
        expression = json.loads(function.arguments)["expression"]
        return str(calculate(ast.parse(expression, mode="eval").body))
    except Exception as exc:  # noqa: BLE001 - a bad call is the model's to fix, in the next turn
        return f"error: {type(exc).__name__}: {exc}"


def calculate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](calculate(node.left), calculate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](calculate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")
