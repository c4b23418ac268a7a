"""An assistant turn as the policy wrote it, answered in OpenAI's shape: its text outside
the calls as ``content``, its calls as ``tool_calls`` (parsed in the checkpoint's own
syntax, inference/tool_calls.py), and ``finish_reason`` "tool_calls" when it called any.

Every call the policy wrote is recorded, valid or not (a broken call that vanished would
dodge the reward it earns). The client is answered the calls it can run: the valid ones,
and of those only the first when the request set ``parallel_tool_calls`` false; a call
not answered is recorded with the reason. A turn whose calls are all broken is answered
as text, its ``content`` the text as written, tags and all.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from rtrl.inference.api import Turn
from rtrl.inference.chat_messages import Tool
from rtrl.inference.tool_calls import parse
from rtrl.trajectory import ToolCall


def call_id(rollout_id: str, turn: int, index: int) -> str:
    """A call's id, the same in a stream's chunk and in the answer."""
    digest = hashlib.sha256(f"{rollout_id}/{turn}/{index}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def answered_turn(
    text: str,
    finish_reason: str,
    *,
    tools: list[Tool] | None,
    family: str | None,
    parallel: bool,
    rollout_id: str,
    turn: int,
) -> tuple[Turn, tuple[ToolCall, ...]]:
    """The turn as answered, and every call it made as recorded. ``tools``: what the
    request offered (None: it offered no ``tools`` field, and the text is only text);
    ``family``: the checkpoint's tool-call syntax (tool_calls.family_of)."""
    if tools is None or family is None:
        return Turn(text, [], finish_reason), ()
    parsed = parse(text, {t.function.name for t in tools}, family)
    recorded = []
    answered: list[dict[str, Any]] = []
    for index, call in enumerate(parsed.calls):
        record = ToolCall(
            call.name,
            call.arguments_json,
            call.valid,
            call.error,
            call_id(rollout_id, turn, index),
            turn,
        )
        if call.valid and answered and not parallel:
            record = replace(
                record, error="not answered: the request set parallel_tool_calls false"
            )
        elif call.valid:
            answered.append(
                {
                    "id": record.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json},
                }
            )
        recorded.append(record)
    if not answered:
        return Turn(text, [], finish_reason), tuple(recorded)
    return Turn(parsed.content.strip(), answered, "tool_calls"), tuple(recorded)
