"""The agent script of the agent tests (a tiny Qwen3 is taught it: rtrl/ops/tiny_agent.py)
and OpenAI's usual tool-calling loop that plays it through the official SDK: offer
``tools``, run the ``tool_calls`` answered, send their results as ``role: "tool"``
messages, append the assistant's message as the SDK returned it."""

from __future__ import annotations

import json
from typing import Any

import openai

from rtrl.inference.arms import assign_arm
from rtrl.ops.tiny_agent import Script, function_tool

TOOLS = (
    function_tool("read_file", "Read a file of the repository", path="the file's path"),
    function_tool("search", "Search the repository", query="what to find"),
)
TOOL_PARAMS: list[Any] = list(TOOLS)
"""The tools as the SDK's create() takes them."""
OPENING = (
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in a.py and b.py."},
)
FILES = {"a.py": "def add(a, b):\n    return a - b\n", "b.py": "print(add(1, 2))\n"}
SEARCH = "a.py:1 b.py:1"
ANSWER = "The bug is in a.py: add returns a - b. Change it to a + b."


def call_text(name: str, **arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


SCRIPT = Script(
    opening=OPENING,
    turns=(
        (
            call_text("read_file", path="a.py") + "\n" + call_text("read_file", path="b.py"),
            tuple({"role": "tool", "tool_call_id": p, "content": c} for p, c in FILES.items()),
        ),
        (
            "Let me search.\n" + call_text("search", query="add("),
            ({"role": "tool", "tool_call_id": "s", "content": SEARCH},),
        ),
        (ANSWER, ()),
    ),
    tools=TOOLS,
)


TREATED = next(u for u in (f"user-{i}" for i in range(100)) if assign_arm(u, 0.5) == "treatment")
"""An end user the treatment arm serves: the trainer trains only the treatment's rollouts."""


def run_tool(call) -> str:
    arguments = json.loads(call.function.arguments)
    if call.function.name == "read_file":
        return FILES[arguments["path"]]
    return SEARCH


async def agent_loop(client: openai.AsyncOpenAI, model: str, **extra) -> dict:
    """OpenAI's loop until the model answers without calling a tool; the second turn
    streamed through the SDK's accumulating helper."""
    messages: list = [dict(m) for m in OPENING]
    answers, streamed_ids = [], []
    for turn in range(4):
        ask = dict(
            model=model, messages=messages, tools=TOOL_PARAMS, seed=turn, max_tokens=200, **extra
        )
        if turn == 1:
            async with client.chat.completions.stream(**ask) as stream:
                async for event in stream:
                    fields = event.chunk.model_extra or {} if event.type == "chunk" else {}
                    if "token_id" in fields:
                        streamed_ids.append(fields["token_id"])
                answer = await stream.get_final_completion()
        else:
            answer = await client.chat.completions.create(**ask)
        answers.append(answer)
        message = answer.choices[0].message
        messages.append(message)  # as the SDK returned it
        if not message.tool_calls:
            return {"answers": answers, "streamed_ids": streamed_ids, "messages": messages}
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    raise AssertionError("the agent never answered")
