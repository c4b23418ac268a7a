"""A chat request's messages and tools, as OpenAI's API takes them, and what the chat
template is given.

Accepted fields are an allow-list of OpenAI's: a message echoed back as the official SDK
returns it is taken as it is (``refusal``, ``annotations``, ``audio``, ``function_call``
and, from its streaming helper, ``parsed``, a call's ``index`` and ``parsed_arguments``:
taken, never read); any other field is a 400 naming it. An assistant turn that only
called tools has ``content: null``; a ``role: "tool"`` message answers one call by its
``tool_call_id``. Content may be a string or a list of text parts (OpenAI's other form);
nothing but text is served.

``template_message`` is the message as transformers' chat templates read it (the
arguments of a call as an object, content a string), and ``canonical`` the form two
requests' histories are compared in (inference/sessions.py): what a client echoes back of
a turn the server answered must equal what it answered.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rtrl.bounded_json import check_depth


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextPart(_Model):
    type: Literal["text"]
    text: str


class FunctionCall(_Model):
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=1_000_000)
    """A JSON object's text, as OpenAI sends it; nested at most MAX_JSON_DEPTH deep, since the
    template and the history's comparison parse it (rtrl/bounded_json.py)."""
    parsed_arguments: Any = None
    """The SDK's streaming helper echoes it back; never read."""

    @field_validator("arguments")
    @classmethod
    def _within_depth(cls, arguments: str) -> str:
        check_depth(arguments)
        return arguments


class ToolCallParam(_Model):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None
    """A streamed call's index, which the SDK's helper echoes back; never read."""


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallParam] | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=256)
    # What the SDK echoes back of an answered turn; taken, never rendered.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None
    parsed: Any = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message, and only one, names its tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is null only in an assistant turn that called tools")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template reads it (``developer`` is ``system`` there)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def canonical(self) -> Canonical:
        """What must match when a later request repeats this message. An assistant turn's
        content is compared without its surrounding whitespace and a call's arguments as
        the value they encode: clients re-serialize what they were answered."""
        calls = tuple(
            (c.id, c.function.name, json.dumps(_arguments(c.function.arguments), sort_keys=True))
            for c in self.tool_calls or ()
        )
        text = self.text.strip() if self.role == "assistant" else self.text
        return (self.role, text, calls, self.tool_call_id, self.name)


Canonical = tuple[Any, ...]
"""A message as two requests' histories are compared (ChatMessage.canonical)."""


class FunctionTool(_Model):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionTool

    def template_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict[Literal["name"], str]


def answered_message(content: str, calls: list[dict[str, Any]]) -> ChatMessage:
    """The assistant turn as the server answered it, in the form a client echoes back."""
    return ChatMessage.model_validate(
        {"role": "assistant", "content": content or None, "tool_calls": calls or None}
        if calls
        else {"role": "assistant", "content": content}
    )


def _arguments(arguments: str) -> Any:
    """A call's arguments as the value they encode (the text when it is not JSON)."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
